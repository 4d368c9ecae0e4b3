"""The DDP baselines of the benchmarks (`elastic.bench.run_ddp`): a rank that gloo aborts while
the ranks tear down, once every rank's work is over, does not fail the benchmark, even when the
other ranks are still leaving; a rank that ends before then fails it, with its traceback if it
raised."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch.multiprocessing as mp

from elastic.bench import run_ddp

pytestmark = pytest.mark.timeout(120)


def _gone(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def _done_then_abort(rank: int, out: str) -> None:
    if rank == 1:  # still leaving when rank 0 has aborted: waits until rank 0 is dead
        while not os.path.exists(f"{out}.pid0") or not _gone(int(pathlib.Path(f"{out}.pid0").read_text())):
            time.sleep(0.05)  # polls an observable condition (no fixed wait)
    pathlib.Path(f"{out}.done{rank}").touch()  # as `leave_ddp` says so before tearing down
    if rank == 0:
        pathlib.Path(f"{out}.pid0.tmp").write_text(str(os.getpid()))
        os.rename(f"{out}.pid0.tmp", f"{out}.pid0")
        os.abort()


def _abort_before_done(rank: int, out: str) -> None:
    if rank == 1:
        os.abort()
    pathlib.Path(f"{out}.done{rank}").touch()


def _raise_before_done(rank: int, out: str) -> None:
    if rank == 1:
        raise RuntimeError("the baseline's own failure")
    pathlib.Path(f"{out}.done{rank}").touch()


def _return_without_done(rank: int, out: str) -> None:
    if rank == 0:
        pathlib.Path(f"{out}.done{rank}").touch()


def test_an_abort_after_a_ranks_work_is_over_waits_for_the_others_to_finish(tmp_path):
    out = str(tmp_path / "out")
    run_ddp(_done_then_abort, (out,), 2, out)
    assert os.path.exists(f"{out}.done1")  # rank 1 was not terminated when rank 0 aborted


def test_a_rank_that_dies_before_its_work_is_over_fails_the_benchmark(tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(mp.ProcessExitedException, match="rank 1"):
        run_ddp(_abort_before_done, (out,), 2, out)


def test_a_rank_that_raises_fails_the_benchmark_with_its_traceback(tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(mp.ProcessRaisedException, match="the baseline's own failure"):
        run_ddp(_raise_before_done, (out,), 2, out)


def test_a_rank_that_ends_cleanly_without_finishing_its_work_fails_the_benchmark(tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(mp.ProcessExitedException, match="rank 1"):
        run_ddp(_return_without_done, (out,), 2, out)
