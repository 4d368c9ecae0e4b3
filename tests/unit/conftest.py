"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch

from elastic.collective import direct
from elastic.trainer.loader import Prefetcher
from tests.procs import warm_context


@pytest.fixture
def prefetcher():
    """Makes `Prefetcher`s (2 loader processes by default) and closes them after.

    The loaders start with `start_method="forkserver"` from the tests' forkserver, which has
    imported torch and the loader (`tests.procs.warm_context`): a spawned loader pays 2 s of
    imports on two cores. The default, "spawn", is what the runs of these tests use
    (`test_loader.py`'s elastic runs, `tests/fault/test_data_faults.py`), the owner that is
    SIGKILLed in `test_loader_processes_exit_when_their_worker_is_sigkilled`, and a test that
    needs slow starts (`start_method="spawn"`)."""
    made: list[Prefetcher] = []
    warm_context()

    def make(job, workers: int = 2, start_method: str = "forkserver", **options) -> Prefetcher:
        p = Prefetcher(job, workers, start_method, torch.get_rng_state(), **options)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def registered_calls(monkeypatch):
    """Counts the allreduces that took the direct allreduce's registered path (a buffer
    reduced where it lies in the shared region), by rank."""
    calls: list[int] = []
    inner = direct._registered

    def spy(comm, *args, **kwargs):
        calls.append(comm.rank)
        return inner(comm, *args, **kwargs)

    monkeypatch.setattr(direct, "_registered", spy)
    return calls
