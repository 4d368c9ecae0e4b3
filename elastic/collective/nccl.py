"""The NCCL backend: `cupy.cuda.nccl` on CUDA tensors, on torch's current stream.

Rank 0 creates the NCCL unique id and publishes it in the generation's rendezvous store; the
others read it. Operations are enqueued on torch's current CUDA stream and tracked by CUDA
events that the communicator polls, together with `ncclCommGetAsyncError`, so that a dead peer
or an `abort()` (which calls `ncclCommAbort`) never leaves a caller blocked.

Needs `pip install elastic[gpu]` (cupy-cuda12x, nvidia-nccl-cu12) and a CUDA device.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.collective.transport import Pending, Transport
from elastic.config import ReduceOp
from elastic.errors import BackendUnavailableError, CollectiveError

_UID_KEY = "nccl_unique_id"

# torch dtype -> name of the NCCL data type constant in cupy.cuda.nccl.
NCCL_DTYPES: dict[torch.dtype, str] = {
    torch.int8: "NCCL_INT8",
    torch.uint8: "NCCL_UINT8",
    torch.int32: "NCCL_INT32",
    torch.int64: "NCCL_INT64",
    torch.float16: "NCCL_FLOAT16",
    torch.bfloat16: "NCCL_BFLOAT16",
    torch.float32: "NCCL_FLOAT32",
    torch.float64: "NCCL_FLOAT64",
}
NCCL_OPS: dict[str, str] = {"sum": "NCCL_SUM", "max": "NCCL_MAX"}


def load_nccl() -> Any:
    """Imports `cupy.cuda.nccl`.

    Raises:
        BackendUnavailableError: cupy or NCCL is not installed, or there is no CUDA device.
    """
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "backend 'nccl' needs a CUDA device and none is visible; use "
            "CollectiveConfig.backend='gloo' on CPU"
        )
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise BackendUnavailableError(
            "backend 'nccl' needs cupy and NCCL: pip install 'elastic[gpu]'"
        ) from e
    return nccl


def nccl_dtype(nccl: Any, dtype: torch.dtype) -> int:
    """The NCCL data type for a torch dtype.

    Raises:
        ValueError: NCCL has no such type.
    """
    name = NCCL_DTYPES.get(dtype)
    if name is None or not hasattr(nccl, name):
        raise ValueError(f"backend 'nccl' cannot reduce tensors of dtype {dtype}")
    return int(getattr(nccl, name))


def encode_unique_id(uid: Sequence[int]) -> bytes:
    """Serialises an NCCL unique id (cupy gives a tuple of 128 small ints) for the store."""
    return json.dumps([int(x) for x in uid]).encode()


def decode_unique_id(data: bytes) -> tuple[int, ...]:
    """Inverse of `encode_unique_id`."""
    return tuple(int(x) for x in json.loads(data.decode()))


# NCCL result codes by number; CuPy's NcclError knows 0-5 only and raises KeyError for the
# others (6 is what a dead peer produces).
NCCL_RESULTS = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError",
                7: "ncclInProgress"}

# How often a pending NCCL operation's event is polled while waiting.
_POLL_S = 0.0002


def describe_nccl_error(error: BaseException) -> str:
    """One line for what CuPy raised from an NCCL call, including the codes it cannot name."""
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], int):
        code = error.args[0]
        return f"NCCL result {code} ({NCCL_RESULTS.get(code, 'unknown to this version')})"
    return str(error) or type(error).__name__


class _CudaPending:
    """Completion of work enqueued on a stream, plus the communicator's async error."""

    def __init__(self, event: torch.cuda.Event, comm: Any) -> None:
        self._event = event
        self._comm = comm

    def is_done(self) -> bool:
        return bool(self._event.query()) or self._async_error() is not None

    def wait(self, timeout: float) -> bool:
        """Polls the event (a CUDA event cannot be waited on with a timeout) and the
        communicator's async error for up to `timeout` seconds; returns `is_done()`."""
        deadline = time.monotonic() + timeout
        while not self.is_done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, _POLL_S))
        return True

    def _async_error(self) -> str | None:
        try:
            self._comm.check_async_error()
        except Exception as e:  # cupy raises NcclError, or KeyError for codes it lacks
            return describe_nccl_error(e)
        return None

    def check(self) -> None:
        error = self._async_error()
        if error is not None:
            raise CollectiveError(f"NCCL reported an asynchronous error: {error}")


class NcclTransport(Transport):
    """NCCL communicator for one generation."""

    name = "nccl"

    def __init__(self, rank: int, world_size: int, store: dist.Store, timeout: timedelta) -> None:
        self._nccl = load_nccl()
        self.rank = rank
        self.world_size = world_size
        if rank == 0:
            uid = self._nccl.get_unique_id()
            store.set(_UID_KEY, encode_unique_id(uid))
        else:
            store.wait([_UID_KEY], timeout)
            uid = decode_unique_id(store.get(_UID_KEY))
        self._comm: Any = self._nccl.NcclCommunicator(world_size, uid, rank)

    def _stream(self) -> int:
        return int(torch.cuda.current_stream().cuda_stream)

    def _pending(self) -> list[Pending]:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return [_CudaPending(event, self._comm)]

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        tag: int,
    ) -> list[Pending]:
        # NCCL matches point-to-point calls in order per peer; the tag is not needed.
        nccl, stream = self._nccl, self._stream()
        nccl.groupStart()
        try:
            for tensor, peer in sends:
                if tensor.numel():
                    self._comm.send(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                    nccl.NCCL_UINT8, peer, stream)
            for tensor, peer in recvs:
                if tensor.numel():
                    self._comm.recv(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                    nccl.NCCL_UINT8, peer, stream)
        finally:
            nccl.groupEnd()
        return self._pending()

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> list[Pending]:
        nccl = self._nccl
        self._comm.allReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                             nccl_dtype(nccl, tensor.dtype), getattr(nccl, NCCL_OPS[op]),
                             self._stream())
        return self._pending()

    def broadcast(self, tensor: torch.Tensor, src: int) -> list[Pending]:
        self._comm.bcast(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                         self._nccl.NCCL_UINT8, src, self._stream())
        return self._pending()

    def abort(self) -> None:
        try:
            self._comm.abort()
        except Exception:  # already aborted or destroyed: nothing left to release
            pass

    def close(self) -> None:
        try:
            self._comm.destroy()
        except Exception:
            pass
