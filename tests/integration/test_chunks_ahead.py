"""Chunks handed out ahead, on real worker actors: the `Workers` port over Ray
(`RayWorkers.start_chunk` / `finish_chunk`) runs each worker's chunks in the order handed out,
and a chunk handed out behind one that did not complete is skipped by every rank."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from pathlib import Path

import pytest
import torch

from elastic.actors.client import ship_job_code
from elastic.actors.workers import RayWorkers
from elastic.adapt.plan import plan_batch
from elastic.collective import RendezvousServer
from elastic.config import BatchConfig, ChaosEvent, FitConfig, ScalingConfig
from elastic.control.port import ChunkDone, ChunkInterrupted, ChunkSkipped, ChunkVotedDown
from tests.jobs import make_dataset, make_model, make_optimizer, mse, regression_job

pytestmark = [pytest.mark.timeout(180)]

B = 16


@pytest.fixture
def workers(ray_cluster, tmp_path):
    with _workers(regression_job(), tmp_path) as pool_and_ids:
        yield pool_and_ids


@contextlib.contextmanager
def _workers(job, tmp_path):
    ship_job_code(job)
    config = FitConfig(run_dir=str(tmp_path), scaling=ScalingConfig(num_workers=2),
                       batch=BatchConfig(global_batch_size=B, autotune=False), max_steps=100)
    server = RendezvousServer()
    pool = RayWorkers(job, config, str(tmp_path), None, server)
    try:
        ids = [pool.spawn(), pool.spawn()]
        started = pool.admit(None, timeout=120)
        assert not started.failed and len(started.members) == 2
        assert pool.connect(ids, 0).ok and pool.sync(ids, 0).ok
        yield pool, ids
    finally:
        pool.shutdown()
        server.close()


def _hung(where):
    return []


def _finish(pool):
    return pool.finish_chunk(60.0, _hung)


def _steps(outcome):
    return [r.step for r in outcome.records]


def _reference(steps):
    """`steps` plain SGD steps over the public order, batch B, one process."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    x, y = make_dataset().tensors
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    for s in range(steps):
        idx = perm[s * B:(s + 1) * B]
        optimizer.zero_grad()
        mse(model, (x[idx], y[idx])).backward()
        optimizer.step()
    return model.state_dict()


def test_a_chunk_handed_out_ahead_runs_right_after_the_one_before(workers):
    pool, ids = workers
    plan = plan_batch(B, 2, None)
    pool.start_chunk(ids, plan, 0, 2, [], None)
    pool.start_chunk(ids, plan, 2, 3, [], None)  # ahead: the first is still running
    first, second = _finish(pool), _finish(pool)
    assert all(isinstance(o, ChunkDone) for o in [*first.outcomes.values(), *second.outcomes.values()])
    assert [_steps(first.outcomes[r]) for r in (0, 1)] == [[0, 1], [0, 1]]
    assert [_steps(second.outcomes[r]) for r in (0, 1)] == [[2, 3, 4], [2, 3, 4]]
    state = pool.call(ids[1], "model_state")
    for name, value in _reference(5).items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-12)


def test_a_chunk_ahead_of_a_voted_down_one_is_skipped_and_the_redo_runs(workers):
    pool, ids = workers
    plan = plan_batch(B, 2, None)
    raise_at_1 = [ChaosEvent(step=1, rank=1, action="raise")]
    pool.start_chunk(ids, plan, 0, 3, raise_at_1, None)
    pool.start_chunk(ids, plan, 3, 3, [], None)
    first, second = _finish(pool), _finish(pool)
    assert all(isinstance(o, ChunkVotedDown) and _steps(o) == [0] for o in first.outcomes.values())
    assert all(isinstance(o, ChunkSkipped) and o.committed_step == 1
               for o in second.outcomes.values())
    pool.start_chunk(ids, plan, 1, 4, [], None)  # the redo is not ahead of anything: it runs
    redo = _finish(pool)
    assert [_steps(redo.outcomes[r]) for r in (0, 1)] == [[1, 2, 3, 4], [1, 2, 3, 4]]
    state = pool.call(ids[0], "model_state")
    for name, value in _reference(5).items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-12)


def test_a_kill_in_a_chunk_releases_the_survivor_and_skips_the_chunk_ahead(workers, tmp_path):
    pool, ids = workers
    plan = plan_batch(B, 2, None)
    pool.start_chunk(ids, plan, 0, 3, [ChaosEvent(step=1, rank=1, action="kill")], None)
    pool.start_chunk(ids, plan, 3, 3, [], None)
    first, second = _finish(pool), _finish(pool)
    assert list(first.lost) == [1] and isinstance(first.outcomes[0], ChunkInterrupted)
    assert _steps(first.outcomes[0]) == [0]
    assert list(second.lost) == [1]
    assert isinstance(second.outcomes[0], ChunkSkipped) and second.outcomes[0].committed_step == 1


def test_yield_ends_the_running_chunk_on_every_rank_after_one_step_and_skips_the_next(workers):
    pool, ids = workers
    plan = plan_batch(B, 2, None)
    pool.start_chunk(ids, plan, 0, 2000, [], None)
    pool.start_chunk(ids, plan, 2000, 4, [], None)
    pool.yield_chunks()
    first, second = _finish(pool), _finish(pool)
    steps = [_steps(first.outcomes[r]) for r in (0, 1)]
    assert all(isinstance(o, ChunkDone) for o in first.outcomes.values())
    assert steps[0] == steps[1] and 1 <= len(steps[0]) < 2000  # the same step on both ranks
    end = len(steps[0])
    assert all(isinstance(o, ChunkSkipped) and o.committed_step == end
               for o in second.outcomes.values())
    pool.start_chunk(ids, plan, end, 2, [], None)  # a later chunk is not ended by that request
    assert [_steps(o) for o in _finish(pool).outcomes.values()] == [[end, end + 1]] * 2


def test_yield_reaches_the_chunk_the_controller_is_waiting_for(workers):
    # No chunk ahead: the controller is already waiting for the only one out when the
    # request comes (from another thread, as the controller actor's request handlers do).
    pool, ids = workers
    plan = plan_batch(B, 2, None)
    pool.start_chunk(ids, plan, 0, 2000, [], None)
    waiting, answers = threading.Event(), pool._answers

    def answers_after_signal(*args):
        waiting.set()
        return answers(*args)

    pool._answers = answers_after_signal
    reports = []
    thread = threading.Thread(target=lambda: reports.append(_finish(pool)))
    thread.start()
    assert waiting.wait(60)
    pool.yield_chunks()
    thread.join(120)
    [report] = reports
    steps = [_steps(report.outcomes[r]) for r in (0, 1)]
    assert all(isinstance(o, ChunkDone) for o in report.outcomes.values())
    assert steps[0] == steps[1] and 1 <= len(steps[0]) < 2000


class _ThreadRecordingLoss:
    """`mse`, noting the process and the thread it ran on (one line per micro-batch)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def note(self) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {threading.get_native_id()}\n")

    def __call__(self, model, batch):
        self.note()
        return mse(model, batch)


def test_every_step_of_a_worker_runs_on_one_thread_whichever_thread_its_chunk_arrived_on(
        ray_cluster, tmp_path):
    # A step on a thread new to it faulted in fresh pages (a new malloc arena) and started
    # PyTorch's per-thread caches cold: chunks handed out ahead arrive on different threads of
    # the actor's pool, and the first step of each was up to 4x as slow as the others.
    # The other calls that touch the replica (here the job's `evaluate`) run there too.
    log = tmp_path / "threads.txt"
    recording = _ThreadRecordingLoss(str(log))
    job = dataclasses.replace(regression_job(), loss=recording,
                              evaluate=lambda model: recording.note() or {"ok": 1.0})
    with _workers(job, tmp_path) as (pool, ids):
        plan = plan_batch(B, 2, None)
        for c in range(6):  # each handed out while the one before runs
            pool.start_chunk(ids, plan, 2 * c, 2, [], None)
        outcomes = [_finish(pool) for _ in range(6)]
        assert all(isinstance(o, ChunkDone) for r in outcomes for o in r.outcomes.values())
        for _ in range(3):
            assert [pool.call(w, "evaluate") for w in ids] == [{"ok": 1.0}] * 2
    threads: dict[str, list[str]] = {}
    for line in Path(log).read_text().splitlines():
        pid, thread = line.split()
        threads.setdefault(pid, []).append(thread)
    assert sorted(len(t) for t in threads.values()) == [15, 15]  # 12 micro-batches, 3 evaluations
    assert all(len(set(t)) == 1 for t in threads.values()), threads
