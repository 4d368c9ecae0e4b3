"""The communicator: collectives for one generation of ranks, abortable from any thread.

A `Communicator` is built from (rank, world size, rendezvous endpoint, generation) and knows
nothing about Ray. Every operation waits on its backend handles by polling them against an
abort flag and a deadline, so `abort()` from another thread makes pending and later operations
raise `CollectiveAbortedError` within a millisecond or so, whatever the backend is doing.
After any failure the communicator is spent: a new generation gets a new communicator.

Two planes when the backend is NCCL: the data plane (`Communicator` itself: gradient
buckets, parameters, CUDA tensors only) runs over NCCL, and the control plane
(`Communicator.control`: votes, loss, ledger, metric names, barriers, peer-restore sizes and
bytes, all host tensors) over the CPU transport (shared memory on one host, gloo across
hosts), formed in the same rendezvous. A failure or abort on either plane breaks both. With
gloo there is one plane and `control` is the communicator itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from elastic.collective import algorithms, direct
from elastic.collective.rendezvous import Endpoint, generation_store, local_address_towards
from elastic.collective.transport import Pending, Transport
from elastic.config import Algorithm, CollectiveConfig, ReduceOp
from elastic.errors import (
    BackendUnavailableError,
    CollectiveAbortedError,
    CollectiveError,
    CollectiveTimeoutError,
    RendezvousError,
)

logger = logging.getLogger(__name__)

# Upper bound on one blocking wait between checks of the abort flag and the deadline; abort()
# normally wakes waiters at once through the transport.
_WAIT_SLICE_S = 0.1


class Communicator:
    """Collectives among `world_size` ranks of one generation.

    Args:
        rank: this rank, in `[0, world_size)`.
        world_size: number of ranks in the generation.
        endpoint: the rendezvous store every rank connects to.
        generation: the generation number; each generation uses its own key namespace.
        config: backend, algorithm and timeouts.
        abort_signal: an event another thread may set to abort the communicator while it is
            still being constructed (connecting); once built, `abort()` does the same and also
            wakes pending waits at once.
        secret: the run's rendezvous secret (`RendezvousServer.secret`); every value read
            from the store must be signed with it.
        shared_bytes: bytes of shared memory this rank lends for registered buffers
            (`shared_buffers`), when the generation's ranks share memory with a host peer and
            `CollectiveConfig.shm_registered_buffers` is on; 0 for none.

    Raises:
        ValueError: rank or world size out of range.
        RendezvousError: the ranks did not all connect within `config.rendezvous_timeout`, or
            a value in the store was not signed with `secret`.
        CollectiveAbortedError: `abort()` was called while connecting.
        BackendUnavailableError: the backend cannot run here.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        endpoint: Endpoint,
        generation: int,
        config: CollectiveConfig | None = None,
        abort_signal: threading.Event | None = None,
        *,
        secret: bytes,
        shared_bytes: int = 0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.config = config or CollectiveConfig()
        self._aborted = abort_signal if abort_signal is not None else threading.Event()
        self._broken: CollectiveError | None = None
        self._shared_bytes = shared_bytes if self.config.shm_registered_buffers else 0
        self._transport, control = self._connect(endpoint, secret)
        self._planes: list[Communicator] = [self]
        self.control: Communicator = self if control is None else self._plane(control)
        """The control plane: host tensors (votes, loss, ledger, barriers, restore bytes).
        The communicator itself unless the data plane is NCCL."""

    def _plane(self, transport: Transport) -> Communicator:
        """A second plane of this generation over `transport`, sharing the abort flag and the
        broken state: a failure on either plane breaks both."""
        plane = object.__new__(Communicator)
        plane.rank, plane.world_size, plane.generation = self.rank, self.world_size, self.generation
        plane.config = self.config.model_copy(update={"algorithm": "auto"})
        plane._aborted = self._aborted
        plane._broken = None
        plane._transport = transport
        plane._planes = self._planes
        plane.control = plane
        self._planes.append(plane)
        return plane

    # --- construction -------------------------------------------------------------------

    def _connect(self, endpoint: Endpoint, secret: bytes) -> tuple[Transport, Transport | None]:
        """Builds the backend in a helper thread so that `abort()` can cut a rendezvous short
        (a backend blocks inside its constructor until every rank has connected)."""
        box: dict[str, object] = {}
        done = threading.Event()
        handover = threading.Lock()  # the caller gives up, or the builder hands over: not both
        timeout = self.config.rendezvous_timeout
        device = _caller_cuda_device(self.config)

        def build() -> None:
            try:
                if device is not None:  # NCCL binds the communicator to the current device
                    torch.cuda.set_device(device)
                with generation_store(endpoint, self.generation, timeout, secret) as store:
                    transports = _make_transports(
                        self.config, self.rank, self.world_size, store,
                        local_address_towards(endpoint.host), self._shared_bytes,
                    )
                    try:
                        store.formed(self.world_size)
                    except BaseException:
                        _close_all(transports)
                        raise
                    with handover:
                        if box.get("abandoned"):
                            _close_all(transports)  # nobody will ever use or close them
                        else:
                            box["transport"] = transports
            except BaseException as e:  # handed to the caller below
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=build, name=f"elastic-rdzv-g{self.generation}", daemon=True).start()
        # One deadline for connecting and the formed barrier; a builder that finishes after
        # it closes what it built (see `_abandon`).
        deadline = time.monotonic() + timeout.total_seconds() + 5.0
        while not done.wait(0.01):
            if self._aborted.is_set():
                self._abandon(box, handover)
                raise CollectiveAbortedError(
                    "communicator aborted during rendezvous", rank=self.rank,
                    generation=self.generation,
                )
            if time.monotonic() > deadline:
                break
        self._abandon(box, handover)
        if "transport" in box:
            return box["transport"]  # type: ignore[return-value]
        error = box.get("error")
        if isinstance(error, (RendezvousError, BackendUnavailableError)):
            raise error
        raise RendezvousError(
            f"rank {self.rank} of {self.world_size} could not connect generation "
            f"{self.generation} within {timeout}; raise CollectiveConfig.rendezvous_timeout if "
            f"workers start slowly ({error})",
            rank=self.rank, generation=self.generation,
        ) from (error if isinstance(error, BaseException) else None)

    @staticmethod
    def _abandon(box: dict[str, object], handover: threading.Lock) -> None:
        """Marks the builder's result as unwanted unless it has already been handed over."""
        with handover:
            if "transport" not in box:
                box["abandoned"] = True

    # --- control ------------------------------------------------------------------------

    def abort(self) -> None:
        """Fails every pending and later operation with `CollectiveAbortedError`. Safe to call
        from any thread, any number of times; never blocks."""
        self._aborted.set()
        for plane in getattr(self, "_planes", ()):
            plane._transport.abort()

    @property
    def transport(self) -> str:
        """What carries this communicator's point-to-point transfers: "gloo" (TCP),
        "shared_memory" (every rank on one host), "shared_memory+gloo" (ranks on several
        hosts: shared memory for the direct allreduce inside each, TCP for the rest) or
        "nccl"."""
        return self._transport.name

    @property
    def aborted(self) -> bool:
        """True once `abort()` was called."""
        return self._aborted.is_set()

    def close(self, timeout: float | None = None) -> bool:
        """Releases the backend. The communicator cannot be used afterwards.

        Args:
            timeout: seconds to wait for the release; None waits as long as it takes. A
                backend that cannot release its state in time (an NCCL communicator whose
                kernels never end) is left to a daemon thread.

        Returns:
            Whether everything was released; False only when `timeout` ran out, and then
            the process holds state it cannot free (a worker should end and be replaced).
        """
        self._aborted.set()

        def release() -> None:
            for plane in reversed(self._planes):
                plane._transport.close()

        if timeout is None:
            release()
            return True
        done = threading.Event()

        def run() -> None:
            try:
                release()
            finally:
                done.set()

        threading.Thread(target=run, name=f"elastic-close-g{self.generation}", daemon=True).start()
        return done.wait(timeout)

    # --- waiting ------------------------------------------------------------------------

    def _fail(self, error: CollectiveError) -> CollectiveError:
        if self._broken is None:
            for plane in self._planes:
                if plane._broken is None:
                    plane._broken = error
                    plane._transport.fail()
        return error

    def _check_usable(self) -> None:
        if self._aborted.is_set():
            raise CollectiveAbortedError(
                "communicator was aborted", rank=self.rank, generation=self.generation
            )
        if self._broken is not None:
            raise CollectiveAbortedError(
                f"communicator is broken by an earlier failure: {self._broken}",
                rank=self.rank, generation=self.generation,
            )

    def wait(self, pending: Sequence[Pending]) -> None:
        """Waits for every handle, or raises on abort, deadline or backend error."""
        deadline = time.monotonic() + self.config.timeout.total_seconds()
        for handle in pending:
            while not handle.is_done():
                if self._aborted.is_set():
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._fail(CollectiveTimeoutError(
                        f"collective did not finish within {self.config.timeout}; raise "
                        "CollectiveConfig.timeout if steps are that slow",
                        rank=self.rank, generation=self.generation,
                    ))
                # abort() wakes this wait through the transport.
                handle.wait(min(remaining, _WAIT_SLICE_S))
            if self._aborted.is_set():
                raise self._fail(CollectiveAbortedError(
                    "operation aborted", rank=self.rank, generation=self.generation
                ))
            try:
                handle.check()
            except Exception as e:
                raise self._fail(CollectiveError(
                    f"collective failed on rank {self.rank} of generation {self.generation}: {e}",
                    rank=self.rank, generation=self.generation,
                )) from e

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        tag: int = 0,
    ) -> list[Pending]:
        """Starts a batch of sends and receives (see `Transport.exchange`)."""
        return self._post(lambda: self._transport.exchange(sends, recvs, tag))

    def recv_reduce(self, tensor: torch.Tensor, src: int, op: ReduceOp, tag: int = 0,
                    scratch: torch.Tensor | None = None) -> list[Pending]:
        """Starts receiving from `src` and reducing into `tensor` (see `Transport.recv_reduce`);
        the result is in place once `wait` returned on the handles."""
        return self._post(lambda: self._transport.recv_reduce(tensor, src, op, tag, scratch))

    def _post(self, start: Callable[[], list[Pending]]) -> list[Pending]:
        """Starts backend operations; a peer's death can surface here (gloo raises when a
        receive is posted on a closed connection), not only when waiting. A `ValueError` or
        `TypeError` is bad input refused before anything was sent (a tensor on the wrong device
        or of a dtype the backend lacks): every rank passes the same tensors and raises alike,
        so it propagates as it is and the communicator stays usable."""
        self._check_usable()
        try:
            return start()
        except (ValueError, TypeError):
            raise
        except Exception as e:
            self._check_usable()  # aborted meanwhile: say so
            raise self._fail(CollectiveError(
                f"collective failed on rank {self.rank} of generation {self.generation}: {e}",
                rank=self.rank, generation=self.generation,
            )) from e

    # --- collectives --------------------------------------------------------------------

    def allreduce(
        self, tensor: torch.Tensor, op: ReduceOp = "sum", algorithm: Algorithm | None = None
    ) -> torch.Tensor:
        """Reduces `tensor` across ranks, in place, and returns it.

        Args:
            tensor: same shape and dtype on every rank.
            op: 'sum', 'avg' (floating point only) or 'max'.
            algorithm: overrides `CollectiveConfig.algorithm` for this call.
        """
        self._check_usable()
        if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}")
        algorithm = algorithm or self.config.algorithm
        host = self._transport.host_group()
        run: Callable[[Communicator, torch.Tensor, ReduceOp], None]
        match algorithm:
            case "auto" if self._transport.name == "nccl":
                run = _native_allreduce
            case "auto" if host is None:
                run = algorithms.ring_allreduce
            case "auto" | "direct" | "hierarchical":
                def run(comm: Communicator, flat: torch.Tensor, op: ReduceOp) -> None:
                    direct.allreduce(comm, host, flat, op)
            case "ring":
                run = algorithms.ring_allreduce
            case "tree":
                run = algorithms.tree_allreduce
            case "halving_doubling":
                run = algorithms.halving_doubling_allreduce
            case "native":
                run = _native_allreduce
            case _:
                raise ValueError(f"unknown allreduce algorithm {algorithm!r}")
        with _contiguous(tensor) as flat:
            if self.world_size > 1 and flat.numel() > 0:
                run(self, flat, "sum" if op == "avg" else op)
            if op == "avg":
                flat.div_(self.world_size)
        return tensor

    @property
    def starts_allreduce(self) -> bool:
        """Whether `start_allreduce` starts sums (else it returns None): the data plane runs
        its collectives in issue order without the host (NCCL, `algorithm` 'auto' or
        'native')."""
        return self._transport.name == "nccl" and self.config.algorithm in ("auto", "native")

    def start_allreduce(self, tensor: torch.Tensor) -> list[Pending] | None:
        """Starts summing a contiguous `tensor` across ranks and returns at once, where the
        data plane runs its collectives in the order they are issued without the host (NCCL,
        with `CollectiveConfig.algorithm` 'auto' or 'native'): `wait` on the handles finishes
        it, and what the caller's stream runs after that sees the sum. So a caller issues the
        next collective while this one runs, as DDP's buckets do. None where the sum is the
        host's work: `allreduce` does it then.

        Raises:
            ValueError: `tensor` is not contiguous.
        """
        self._check_usable()
        if not self.starts_allreduce:
            return None
        if not tensor.is_contiguous():
            raise ValueError("start_allreduce needs a contiguous tensor")
        if self.world_size == 1 or tensor.numel() == 0:
            return []
        flat = tensor.view(-1)
        return self._post(lambda: self._transport.allreduce(flat, "sum"))

    def shared_buffers(self, sizes: dict[torch.dtype, int]) -> dict[torch.dtype, torch.Tensor] | None:
        """Host buffers of `sizes[dtype]` elements each in this rank's shared region, or None
        (no region, or they do not fit). An allreduce of one of them, whole, with the
        'direct', 'hierarchical' or 'auto' algorithm, reduces it where it lies instead of
        copying it through the transport's buffers. Every rank must then allreduce its own
        buffer taken with the same sizes: ranks of one host that pass different buffers fail
        the collective, but ranks on different hosts are not compared (their network transfers
        then differ, as they would for tensors of different sizes). Every rank of a generation
        lends a region of the same size, or none does. The memory is lent, not given: a later
        call returns the same memory, and after a failed allreduce the content is
        undefined."""
        host = self._transport.host_group()
        if host is None or len(host.local) < 2 or self._broken is not None:
            return None
        return host.shared_buffers(sizes)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduces `tensor` across ranks and returns this rank's part: chunk `rank` of
        `tensor.flatten().tensor_split(world_size)` (chunks may differ in length by one).
        `tensor` is used as scratch space."""
        self._check_usable()
        with _contiguous(tensor) as flat:
            chunks = flat.tensor_split(self.world_size)
            if self.world_size > 1:
                algorithms.ring_reduce_scatter(self, chunks, "sum" if op == "avg" else op)
            mine = chunks[self.rank].clone()
        if op == "avg":
            mine.div_(self.world_size)
        return mine

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns a tensor of shape `(world_size, *tensor.shape)` holding every rank's
        `tensor` in rank order."""
        self._check_usable()
        out = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        out[self.rank].copy_(tensor)
        if self.world_size > 1:
            algorithms.ring_allgather(self, list(out.reshape(self.world_size, -1).unbind(0)))
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrites `tensor` on every rank with its value on `src`, in place."""
        self._check_usable()
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be in [0, {self.world_size}), got {src}")
        with _contiguous(tensor) as flat:
            if self.world_size > 1 and flat.numel() > 0:
                self.wait(self._post(lambda: self._transport.broadcast(flat, src)))
        return tensor

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Sends a contiguous tensor to rank `dst` and waits until it is sent."""
        self.wait(self.exchange([(tensor, dst)], [], tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receives into a contiguous tensor from rank `src`."""
        self.wait(self.exchange([], [(tensor, src)], tag))
        return tensor

    def barrier(self) -> None:
        """Returns once every rank has entered the barrier (on the control plane)."""
        plane = self.control
        plane._check_usable()
        if self.world_size > 1:
            plane.wait(plane._post(lambda: plane._transport.allreduce(torch.zeros(1), "sum")))


def _native_allreduce(comm: Communicator, flat: torch.Tensor, op: ReduceOp) -> None:
    comm.wait(comm._post(lambda: comm._transport.allreduce(flat, op)))


class _contiguous:
    """Yields a flat contiguous view of a tensor, copying back on exit if one was needed."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self._copy = not tensor.is_contiguous()

    def __enter__(self) -> torch.Tensor:
        self._flat = (self._tensor.contiguous() if self._copy else self._tensor).view(-1)
        return self._flat

    def __exit__(self, *exc: object) -> None:
        if self._copy and exc[0] is None:
            self._tensor.copy_(self._flat.view(self._tensor.shape))


def _caller_cuda_device(config: CollectiveConfig) -> int | None:
    """The calling thread's CUDA device when the data plane is real NCCL (the builder thread
    must use the same one), else None."""
    if config.backend != "nccl" or config.nccl_simulator or not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()


def _close_all(transports: tuple[Transport, Transport | None]) -> None:
    for transport in transports:
        if transport is not None:
            transport.close()


def _make_transports(
    config: CollectiveConfig, rank: int, world_size: int, store: object, address: str,
    shared_bytes: int = 0,
) -> tuple[Transport, Transport | None]:
    """The data plane's transport and, when it is NCCL, the control plane's (the CPU
    transport the gloo backend uses on its own; the registered buffers' region belongs to a
    CPU data plane only)."""
    match config.backend:
        case "gloo" | "auto":  # 'auto' outside a FitConfig, which resolves it: the host plane
            return _cpu_transport(config, rank, world_size, store, address, shared_bytes), None
        case "nccl":
            control = _cpu_transport(config, rank, world_size, store, address)
            try:
                from elastic.collective.nccl import NcclTransport

                data = NcclTransport(rank, world_size, store,  # type: ignore[arg-type]
                                     config.rendezvous_timeout, simulated=config.nccl_simulator)
            except BaseException:
                control.close()
                raise
            return data, control
        case _:
            raise ValueError(f"unknown backend {config.backend!r}")


def _cpu_transport(
    config: CollectiveConfig, rank: int, world_size: int, store: object, address: str,
    shared_bytes: int = 0,
) -> Transport:
    """gloo's TCP transfers, with shared memory between the ranks of a host where it works."""
    from elastic.collective.gloo import GlooTransport

    # gloo applies its timeout to connecting as well as to operations; our own deadline
    # enforces config.timeout per operation, so gloo's is only a backstop.
    backstop = max(config.timeout, config.rendezvous_timeout)
    gloo = GlooTransport(rank, world_size, store, address, backstop)  # type: ignore[arg-type]
    if not config.shared_memory or world_size == 1:
        return gloo
    from elastic.collective import shm

    try:
        links = shm.connect(rank, world_size, store, config.shm_channel_bytes,  # type: ignore[arg-type]
                            config.shm_chunk_bytes, config.simulated_hosts, shared_bytes)
    except BaseException:
        gloo.close()
        raise
    return gloo if links is None else shm.SharedMemoryTransport(links, gloo)
