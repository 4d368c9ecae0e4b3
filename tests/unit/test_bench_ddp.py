"""The DDP baselines of the benchmarks (`elastic.bench.run_ddp`): a rank that gloo aborts while
the ranks tear down, once every rank's work is over, does not fail the benchmark; a rank that
dies before then does."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch.multiprocessing as mp

from elastic.bench import run_ddp

pytestmark = pytest.mark.timeout(120)


def _done_then_abort(rank: int, out: str) -> None:
    pathlib.Path(f"{out}.done{rank}").touch()  # as `leave_ddp` says so before tearing down
    os.abort()


def _abort_before_done(rank: int, out: str) -> None:
    if rank == 1:
        os.abort()
    pathlib.Path(f"{out}.done{rank}").touch()


def test_an_abort_after_every_rank_is_done_leaves_the_results(tmp_path):
    out = str(tmp_path / "out")
    run_ddp(_done_then_abort, (out,), 2, out)


def test_a_rank_that_dies_before_its_work_is_over_fails_the_benchmark(tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(mp.ProcessExitedException):
        run_ddp(_abort_before_done, (out,), 2, out)
