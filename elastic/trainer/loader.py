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
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import torch
from torch.utils.data import default_collate

__all__ = ["LoadError", "Piece", "Prefetcher", "generator_state", "load_piece",
           "seed_generators", "set_generator_state"]


class LoadError(Exception):
    """Reading a micro-batch failed in a loader process; the message carries that process's
    traceback. Raised in the worker's step, where it becomes the rank's user-error vote."""


@dataclass(frozen=True)
class Piece:
    """One micro-batch to read: its step, the seed of its generators and its samples."""

    step: int
    seed: int
    indices: tuple[int, ...]


def seed_generators(seed: int) -> None:
    """Seeds torch's (CPU and CUDA), Python's and NumPy's global generators with `seed`."""
    torch.manual_seed(seed)
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
               seed: int) -> Any:
    """Seeds the generators, reads the samples, collates them: one micro-batch."""
    seed_generators(seed)
    return collate(read_samples(dataset, indices))


# --- the loader process side ------------------------------------------------------------

_dataset: Any = None
_collate: Callable[[list[Any]], Any] = default_collate
_init_error: str | None = None


def _watch_parent(alive: Any) -> None:
    """Exits this process when the worker's end of `alive` closes (the worker closed its
    loaders, or died)."""
    try:
        alive.recv()
    except (EOFError, OSError):
        pass
    os._exit(0)


def _init_loader(alive: Any, job_bytes: bytes, rng_state: torch.Tensor) -> None:
    """Runs once in each loader process: builds the data set as the worker did (the factory
    called with the torch generator in the worker's state at that moment)."""
    global _dataset, _collate, _init_error
    threading.Thread(target=_watch_parent, args=(alive,), daemon=True,
                     name="elastic-loader-parent").start()
    torch.set_num_threads(1)
    try:
        job = cloudpickle.loads(job_bytes)
        torch.set_rng_state(rng_state)
        _dataset = job.dataset()
        _collate = job.collate_fn or default_collate
    except Exception:
        _init_error = "building the data set in a loader process failed:\n" + traceback.format_exc()


def _load(indices: tuple[int, ...], seed: int) -> tuple[bool, Any, Any]:
    """(True, batch, generator state after reading) or (False, traceback, None)."""
    if _init_error is not None:
        return False, _init_error, None
    try:
        return True, load_piece(_dataset, _collate, indices, seed), generator_state()
    except Exception:
        return False, traceback.format_exc(), None


def _ready() -> int:
    return os.getpid()


# --- the worker side ----------------------------------------------------------------------


class Prefetcher:
    """Loader processes reading the pieces a worker will want next.

    Args:
        job: the user's job (its `dataset` and `collate_fn` factories run in every loader).
        workers: loader processes.
        start_method: 'spawn' or 'forkserver'.
        rng_state: torch's generator state in which the worker called `job.dataset()`.
        pin_memory: pin every batch taken (for copies to a GPU).
    """

    def __init__(self, job: Any, workers: int, start_method: str, rng_state: torch.Tensor,
                 pin_memory: bool = False) -> None:
        self._job_bytes = cloudpickle.dumps(job)
        self._workers = workers
        self._context = multiprocessing.get_context(start_method)
        self._rng_state = rng_state.clone()
        self._pin = pin_memory
        self._futures: dict[Piece, Future] = {}
        self.served = 0  # pieces handed out read ahead (diagnostics, tests)
        self.submitted = 0  # pieces given to the loader processes
        self._pool: ProcessPoolExecutor | None = None
        self._alive: Any = None
        self._start()

    def _start(self) -> None:
        reader, writer = self._context.Pipe(duplex=False)
        self._pool = ProcessPoolExecutor(self._workers, mp_context=self._context,
                                         initializer=_init_loader,
                                         initargs=(reader, self._job_bytes, self._rng_state))
        # Loader processes get the reading end (processes start on demand, so the worker keeps
        # one to hand out); only the worker holds the writing end.
        self._alive = (reader, writer)
        for _ in range(self._workers):  # starts the processes now, not at the first step
            self._pool.submit(_ready)

    def pids(self) -> list[int]:
        """The loader processes' ids (for tests and diagnostics)."""
        pool = self._pool
        return [] if pool is None else [p.pid for p in list(pool._processes.values())
                                        if p.pid is not None]

    def want(self, pieces: Sequence[Piece]) -> None:
        """Reads `pieces` in this order (those not already read or being read) and drops every
        other piece read or queued so far."""
        wanted = set(pieces)
        for piece in [p for p in self._futures if p not in wanted]:
            self._futures.pop(piece).cancel()
        for piece in pieces:
            if piece not in self._futures:
                self._futures[piece] = self._submit(piece)

    def _submit(self, piece: Piece) -> Future:
        assert self._pool is not None
        self.submitted += 1
        try:
            return self._pool.submit(_load, piece.indices, piece.seed)
        except BrokenProcessPool:
            self._restart()
            assert self._pool is not None
            return self._pool.submit(_load, piece.indices, piece.seed)

    def take(self, piece: Piece) -> tuple[Any, Any] | None:
        """The batch of `piece` and the generators' state after reading it, or None when it
        was not asked for (the caller reads it itself).

        Raises:
            LoadError: the data set or collate function raised in the loader process (its
                traceback in the message), or a loader process died.
        """
        future = self._futures.pop(piece, None)
        if future is None:
            return None
        try:
            ok, value, state = future.result()
        except BrokenProcessPool:
            self._restart()
            raise LoadError(
                f"a loader process of this worker died (killed, or crashed in native code) "
                f"while reading step {piece.step}'s samples; its loaders were restarted") from None
        if not ok:
            raise LoadError(f"in a loader process (step {piece.step}):\n{value}")
        self.served += 1
        return (_pin(value) if self._pin else value), state

    def _restart(self) -> None:
        self._shutdown()
        self._futures.clear()
        self._start()

    def _shutdown(self) -> None:
        pool, alive = self._pool, self._alive
        self._pool = self._alive = None
        if alive is not None:
            for end in alive:
                end.close()  # every loader exits, even one stuck in user code
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """Stops the loader processes and waits for them to exit."""
        self._futures.clear()
        self._shutdown()


def _pin(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: _pin(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        pinned = [_pin(v) for v in batch]
        return type(batch)(*pinned) if hasattr(batch, "_fields") else type(batch)(pinned)
    return batch
