"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch

from elastic.trainer.loader import Prefetcher


@pytest.fixture
def prefetcher():
    """Makes `Prefetcher`s (spawned loader processes, 2 by default) and closes them after."""
    made: list[Prefetcher] = []

    def make(job, workers: int = 2) -> Prefetcher:
        p = Prefetcher(job, workers, "spawn", torch.get_rng_state())
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
