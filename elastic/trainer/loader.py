"""Reading a worker's micro-batches: in the worker itself, or ahead of time in loader processes.

A micro-batch ("piece") is fully described by the step it belongs to, the data set indices it
holds and the seed its random-number generators start from (`forward_seed`): `load_piece`
seeds torch's, Python's and NumPy's global generators with it, reads the samples (through
`__getitems__` when the data set has it, as `DataLoader` does) and collates them. The forward
pass then continues the same generators. A loader process runs exactly that and hands back the
batch together with the generators' state after reading, which the worker adopts before its
forward pass: the result is the same bits as reading in the worker, wherever and whenever the
piece was read.

`Prefetcher` keeps loader processes reading the pieces of the next steps. It is told, at every
step, which pieces are wanted (the current step's and those of the next `prefetch_steps`
steps, predicted from the cursor and the plan); anything read ahead for another plan is
dropped, never trained on, so exactly-once is a property of the indices the step asks for, as
without loader processes. Loader processes exit when the worker closes them and, through a
pipe only the worker holds, when the worker process dies for any reason (SIGKILL included).

A loader process says once that it has built the data set (or failed to: that failure is then
the answer to every request, so that it reaches the step's vote), and `wait_started` waits for
that: the worker calls it while it is built, before the controller admits it, so that a worker
joining a running generation does not hold every rank's first step while its loaders build the
data set (2.3 s of CPU each for the data bench's 512 PNGs).

Each loader process has a pipe to the worker; requests go out and batches come in only inside
`want` and `take`, on the training thread. Every batch a loader sends is received, those
dropped included: a tensor's shared memory stays open in the loader until the worker takes
its handle. With `pin_memory` (GPU workers) a batch is copied into page-locked memory once it
is received (at a step's `want`, or a `take`), on one thread of the worker's (as
`DataLoader`'s pin-memory thread), while the step goes on: the copy (19 MB for a batch of 128
ResNet images) runs in C++ without the GIL, and the step that takes the batch finds it pinned
instead of copying it on its own path. That thread is the only one that wakes during forward
and backward. A piece dropped before its copy began is never copied; the pinned copies of the
pieces read ahead stay in page-locked memory until taken (torch's host allocator keeps the
blocks for the next ones).
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import random
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

import cloudpickle
import numpy as np
import torch
import torch.multiprocessing  # registers the shared-memory reductions of tensors
from torch.utils.data import default_collate

from elastic.trainer.device import UnbuildableBatch, map_tensors

__all__ = ["LoadError", "Piece", "Prefetcher", "generator_state", "load_piece", "pin_batch",
           "seed_generators", "seed_torch", "set_generator_state"]

# Requests a loader process holds unanswered (the one it reads and those queued behind it);
# the rest of the wanted pieces wait in the worker, so a replan wastes at most these reads.
_QUEUED_PER_LOADER = 2

# A loader process's first message: it has built the data set (or failed to).
_STARTED = "started"


class LoadError(Exception):
    """Reading a micro-batch failed in a loader process; the message carries that process's
    traceback. Raised in the worker's step, where it becomes the rank's user-error vote."""


@dataclass(frozen=True)
class Piece:
    """One micro-batch to read: its step, the seed of its generators and its samples."""

    step: int
    seed: int
    indices: tuple[int, ...]


def seed_torch(seed: int) -> None:
    """`torch.manual_seed(seed)`: the CPU generator and, once this process uses CUDA (a GPU
    worker moved its model there when it was built), every CUDA device's. Before that the CPU
    generator alone: `torch.manual_seed` would queue a lazy seed for each accelerator torch
    was built for, formatting a stack trace for each (about 1 ms of CPU per call, once per
    micro-batch), in CPU workers and loader processes that never use one."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def seed_generators(seed: int) -> None:
    """Seeds torch's (CPU and CUDA: `seed_torch`), Python's and NumPy's global generators
    with `seed`."""
    seed_torch(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))


def seed_others_from_torch() -> None:
    """Seeds Python's and NumPy's global generators from torch's current state (which is
    left as it is), so that a data set factory that draws from them (a `random.shuffle` of
    its files, a NumPy permutation, a split without a fixed seed) builds the same data set
    on every rank and in every loader process, as one built under the same torch state does."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).digest()
    seed = int.from_bytes(digest[:8], "little")
    random.seed(seed)
    np.random.seed(seed % (1 << 32))


def generator_state() -> tuple[torch.Tensor, Any, Any]:
    """The CPU generators' state: torch's, Python's and NumPy's."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def set_generator_state(state: tuple[torch.Tensor, Any, Any]) -> None:
    torch_state, python_state, numpy_state = state
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)


def read_samples(dataset: Any, indices: Sequence[int]) -> list[Any]:
    """The samples at `indices`, through `__getitems__` when the data set has one."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems is not None:
        return list(getitems(list(indices)))
    return [dataset[int(i)] for i in indices]


def load_piece(dataset: Any, collate: Callable[[list[Any]], Any], indices: Sequence[int],
               seed: int, one_thread: bool = False) -> Any:
    """Seeds the generators, reads the samples, collates them: one micro-batch. With
    `one_thread` (exact mode, in the worker) under one intra-op thread, as in a loader
    process: a transform or collate that reduces (a mean, ColorJitter's contrast) gives other
    bits at other thread counts, and a piece is read in the worker when its loader died, or
    by a run resumed without loader processes."""
    seed_generators(seed)
    if not one_thread or torch.get_num_threads() == 1:
        return collate(read_samples(dataset, indices))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return collate(read_samples(dataset, indices))
    finally:
        torch.set_num_threads(threads)


# --- the loader process side ------------------------------------------------------------


def _watch_parent(alive: Connection) -> None:
    """Exits this process when the worker's end of `alive` closes (the worker closed its
    loaders, or died), even while the main thread is in user code."""
    try:
        alive.recv()
    except (EOFError, OSError):
        pass
    os._exit(0)


def _serve(conn: Connection, alive: Connection, job_bytes: bytes, rng_state: bytes) -> None:
    """A loader process: builds the data set as the worker did (the factory called with the
    torch generator in the worker's state at that moment), then answers each request
    `(indices, seed)` on `conn`, in order, with `(True, batch, packed generator state)` or
    `(False, traceback, None)`."""
    threading.Thread(target=_watch_parent, args=(alive,), daemon=True,
                     name="elastic-loader-parent").start()
    torch.set_num_threads(1)
    dataset: Any = None
    collate: Callable[[list[Any]], Any] = default_collate
    init_error: str | None = None
    try:
        job = cloudpickle.loads(job_bytes)
        torch.set_rng_state(torch.frombuffer(bytearray(rng_state), dtype=torch.uint8))
        seed_others_from_torch()
        dataset = job.dataset()
        collate = job.collate_fn or default_collate
    except Exception:
        init_error = "building the data set in a loader process failed:\n" + traceback.format_exc()
    try:
        conn.send_bytes(ForkingPickler.dumps(_STARTED))
    except OSError:  # the worker closed its loaders meanwhile
        os._exit(0)
    while True:
        try:
            indices, seed = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        reply: tuple[bool, Any, Any] = (False, init_error, None)
        if init_error is None:
            try:
                reply = (True, load_piece(dataset, collate, indices, seed),
                         _pack_state(generator_state()))
            except Exception:
                reply = (False, traceback.format_exc(), None)
        try:
            message = ForkingPickler.dumps(reply)
        except Exception:  # a batch that cannot be sent: the user's error, as one that cannot be read
            message = ForkingPickler.dumps(
                (False, "sending the batch to the worker failed:\n" + traceback.format_exc(), None))
        del reply  # the batch's shared memory lives on in `message` until the worker takes it
        conn.send_bytes(message)


def _pack_state(state: tuple[torch.Tensor, Any, Any]) -> tuple[bytes, Any, Any]:
    """The generators' state with torch's as bytes: sent inline, not as one more tensor in
    shared memory."""
    torch_state, python_state, numpy_state = state
    return torch_state.numpy().tobytes(), python_state, numpy_state


def _unpack_state(packed: tuple[bytes, Any, Any]) -> tuple[torch.Tensor, Any, Any]:
    torch_state, python_state, numpy_state = packed
    return torch.frombuffer(bytearray(torch_state), dtype=torch.uint8), python_state, numpy_state


# --- the worker side ----------------------------------------------------------------------


@dataclass(eq=False)
class _Loader:
    """A loader process, the worker's end of its pipe, and the pieces it was asked for and has
    not answered yet, in order (it answers in order, after its start notice)."""

    process: BaseProcess
    conn: Connection
    asked: deque[Piece] = field(default_factory=deque)
    started: bool = False  # its start notice was received


class Prefetcher:
    """Loader processes reading the pieces a worker will want next.

    Args:
        job: the user's job (its `dataset` and `collate_fn` factories run in every loader).
        workers: loader processes.
        start_method: 'spawn' or 'forkserver'.
        rng_state: torch's generator state in which the worker called `job.dataset()`.
        pin_memory: pin every batch (for copies to a GPU), in the background as it arrives.
        device: the worker's GPU, which the pinning thread makes its current device (as
            `DataLoader`'s pin-memory thread does).
    """

    def __init__(self, job: Any, workers: int, start_method: str, rng_state: torch.Tensor,
                 pin_memory: bool = False, device: torch.device | None = None) -> None:
        self._job_bytes = cloudpickle.dumps(job)
        self._context = multiprocessing.get_context(start_method)
        self._rng_state = rng_state.numpy().tobytes()
        self._pinner = ThreadPoolExecutor(1, "elastic-pin") if pin_memory else None
        self._device = device
        self._wanted: dict[Piece, None] = {}  # in the order they will be taken
        # Received, still wanted: (ok, batch or its pinning, generators' state).
        self._ready: dict[Piece, tuple[bool, Any, Any]] = {}
        self._lost: set[Piece] = set()  # were being read when their loader died
        self._loaders: list[_Loader] = []
        self._closed = False
        self.served = 0  # pieces handed out read ahead (diagnostics, tests)
        self.submitted = 0  # pieces queued for the loader processes
        # Loader processes get the reading end (a replacement for one that died too); only the
        # worker holds the writing end.
        self._alive = self._context.Pipe(duplex=False)
        try:
            for _ in range(workers):
                self._loaders.append(self._spawn())
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> _Loader:
        conn, theirs = self._context.Pipe()
        process = self._context.Process(
            target=_serve, args=(theirs, self._alive[0], self._job_bytes, self._rng_state),
            name="elastic-loader", daemon=True)
        try:
            process.start()
        finally:
            theirs.close()
        return _Loader(process, conn)

    def wait_started(self, timeout: float | None = None) -> bool:
        """Waits until every loader process has built the data set (or failed to, or died:
        both come out at the first piece it is asked for, as without this wait), for at most
        `timeout` seconds; False if some loader was still building it then (the first piece
        asked of it then waits for it, as without this wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = [loader for loader in self._loaders if not loader.started]
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            ready = set(wait([loader.conn for loader in pending]
                             + [loader.process.sentinel for loader in pending], left))
            pending = [loader for loader in pending
                       if (loader.conn not in ready or self._receive(loader))
                       and loader.process.sentinel not in ready and not loader.started]
        return True

    def pids(self) -> list[int]:
        """The loader processes' ids (for tests and diagnostics)."""
        return [loader.process.pid for loader in self._loaders if loader.process.pid is not None]

    def want(self, pieces: Sequence[Piece]) -> None:
        """Reads `pieces` in this order (those not already read or being read) and drops every
        other piece read or queued so far."""
        if self._closed:
            return
        wanted = dict.fromkeys(p for p in pieces if p not in self._lost)
        asked = self._asked()
        self.submitted += sum(1 for p in wanted if p not in self._wanted
                              and p not in self._ready and p not in asked)
        self._wanted = wanted
        for piece in [p for p in self._ready if p not in wanted]:
            _, value, _ = self._ready.pop(piece)  # its shared memory goes with it
            if isinstance(value, Future):
                value.cancel()  # not copied, if its turn has not come
        self._receive_sent()
        self._send()

    def take(self, piece: Piece) -> tuple[Any, Any] | None:
        """The batch of `piece` and the generators' state after reading it, or None when it
        was not asked for (the caller reads it itself).

        Raises:
            LoadError: the data set or collate function raised in the loader process (its
                traceback in the message), or a loader process died with the piece.
        """
        if piece not in self._wanted:
            return None
        while piece not in self._ready:
            self._send()
            if piece not in self._wanted:  # its loader died as it was sent: read it here
                return None
            waiting = [loader for loader in self._loaders if loader.asked]
            ready = set(wait([loader.conn for loader in waiting]
                             + [loader.process.sentinel for loader in self._loaders]))
            dead = {loader for loader in waiting
                    if loader.conn in ready and not self._receive(loader)}
            dead |= {loader for loader in self._loaders if loader.process.sentinel in ready}
            for loader in dead:
                if piece in self._bury(loader):
                    raise LoadError(
                        f"a loader process of this worker died (killed, or crashed in native "
                        f"code) while reading step {piece.step}'s samples; it was restarted")
        del self._wanted[piece]
        ok, value, state = self._ready.pop(piece)
        if self._pinner is not None:
            self._receive_sent()  # the next pieces, if here, are pinned during this step
        self._send()  # (after receiving: a loader that answered takes its next request now)
        if not ok:
            raise LoadError(f"in a loader process (step {piece.step}):\n{value}")
        self.served += 1
        if isinstance(value, Future):
            value = value.result()  # its pinning's error, if any, raised here (the step's)
        return value, _unpack_state(state)

    def _asked(self) -> set[Piece]:
        return {piece for loader in self._loaders for piece in loader.asked}

    def _send(self) -> None:
        """Asks the least busy loaders for the wanted pieces nobody has read or is reading,
        in order, up to `_QUEUED_PER_LOADER` each."""
        asked = self._asked()
        for piece in self._wanted:
            if piece in self._ready or piece in asked:
                continue
            loader = min(self._loaders, key=lambda lo: len(lo.asked))
            if len(loader.asked) >= _QUEUED_PER_LOADER:
                return
            try:
                loader.conn.send((piece.indices, piece.seed))
            except OSError:  # it died
                self._bury(loader)
                return self._send()
            loader.asked.append(piece)
            asked.add(piece)

    def _receive_sent(self) -> None:
        """Receives, without waiting, what the loaders have sent; replaces any that died."""
        dead = set(wait([loader.process.sentinel for loader in self._loaders], timeout=0))
        for loader in list(self._loaders):
            if not self._receive(loader) or loader.process.sentinel in dead:
                self._bury(loader)

    def _receive(self, loader: _Loader) -> bool:
        """Receives every answer `loader` has sent, keeping those still wanted: a dropped one
        is unpickled too, which takes its shared memory from the loader and frees it here.
        False when its pipe closed: it died."""
        try:
            while (loader.asked or not loader.started) and loader.conn.poll():
                message = loader.conn.recv_bytes()
                if not loader.started:  # its first message, whenever it comes
                    if ForkingPickler.loads(message) != _STARTED:
                        return False  # not a loader of this protocol: treated as dead
                    loader.started = True
                    continue
                # Popped before unpickling: a reply is never shifted onto the next piece.
                piece = loader.asked.popleft()
                try:
                    reply = ForkingPickler.loads(message)
                except Exception:
                    # A whole message that cannot be read back here (no file descriptors or
                    # /dev/shm left, a __reduce__ that fails in this process): that piece is
                    # lost for good and the worker reads it itself (asked again, it could fail
                    # again and again); the loader and its next replies are fine.
                    if self._wanted.pop(piece, None) is not None:
                        self._lost.add(piece)
                    continue
                if piece in self._wanted:
                    ok, value, state = reply
                    if ok and self._pinner is not None:
                        value = self._pinner.submit(_pinned, value, self._device)
                    self._ready[piece] = (ok, value, state)
        except Exception:  # EOFError, OSError: it died; anything else: its reply is unusable
            return False
        return True

    def _bury(self, loader: _Loader) -> set[Piece]:
        """Replaces `loader`, which died, and returns the wanted pieces it took with it: they
        are dropped for good (the worker reads them itself), so that a piece that crashes its
        loader cannot crash one after another."""
        self._receive(loader)  # what it sent before it died
        lost = {piece for piece in loader.asked if piece in self._wanted}
        for piece in lost:
            del self._wanted[piece]
        self._lost |= lost
        self._stop([loader])
        self._loaders[self._loaders.index(loader)] = self._spawn()
        return lost

    def _stop(self, loaders: list[_Loader]) -> None:
        for loader in loaders:
            loader.conn.close()  # a loader waiting for a request exits
            loader.asked.clear()
        for loader in loaders:
            loader.process.join(timeout=5)
            if loader.process.exitcode is None:  # in user code that ignores its closed pipe
                loader.process.kill()
                loader.process.join()

    def close(self) -> None:
        """Stops the loader processes and waits for them to exit."""
        self._closed = True
        self._wanted.clear()
        for _, value, _ in self._ready.values():
            if isinstance(value, Future):
                value.cancel()
        self._ready.clear()
        for end in self._alive:
            end.close()  # every loader exits, even one stuck in user code
        loaders, self._loaders = self._loaders, []
        self._stop(loaders)
        if self._pinner is not None:  # waits for the copy under way, if any
            self._pinner.shutdown(wait=True, cancel_futures=True)


def _pinned(batch: Any, device: torch.device | None) -> Any:
    """On the pinning thread: `batch` in page-locked memory, with the worker's GPU `device`
    as the thread's current device (CUDA's current device is per thread; bound as
    `DataLoader`'s pin-memory thread binds it)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    return pin_batch(batch)


def pin_batch(batch: Any) -> Any:
    """`batch` with every tensor in page-locked memory, in the containers `move_batch` takes
    (kept with their types: OrderedDict, Hugging Face's `BatchEncoding`, dataclasses, named
    tuples, list subclasses); a batch holding a container it cannot rebuild stays as it is
    (the job's own `TrainJob.move_batch` may know it; the default move says what to do). So
    does a batch that page-locked memory has no room for (`cudaHostAlloc` failed: the batches
    read ahead hold it, or the host's limit on locked memory): its copy to the GPU then waits,
    training goes on, and the first such failure is logged."""
    try:
        return map_tensors(batch, _page_locked)
    except UnbuildableBatch:
        return batch
    except RuntimeError as e:
        global _unpinned_said
        if not _unpinned_said:
            _unpinned_said = True
            _logger.warning("data.pin_memory: a batch could not be pinned (%s); it is copied to "
                            "the GPU from pageable memory, and so is any other that cannot be "
                            "(fewer data.prefetch_steps hold less pinned memory)", e)
        return batch


_logger = logging.getLogger(__name__)
_unpinned_said = False


def _page_locked(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type != "cpu" or t.is_pinned() else t.pin_memory()
