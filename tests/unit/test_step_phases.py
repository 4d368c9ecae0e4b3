"""The phases of a training step (compute, reduce, verdict, apply), checked without Ray: the
verdict as a pure function of the votes, the metadata layout, the flat reduce, and whole steps
on ranks that run as threads of the test process."""

import ast
import os
import pathlib
import signal
import threading
from types import SimpleNamespace

import pytest
import torch

from elastic import BatchConfig, ChaosEvent, FitConfig, ScalingConfig
from elastic.adapt.plan import BatchPlan
from elastic.collective import RendezvousServer
from elastic.config import CollectiveConfig
from elastic.trainer.flat import all_finite, allreduce_flat, flatten_grads, unflatten_grads
from elastic.trainer.loss import LossForm
from elastic.trainer.replica import NonFinite, OutOfMemory, Replica, StepRecord, UserFailure
from elastic.trainer.step import Commit, Reduced, StepContext, Vote, pack_meta, verdict
from tests.jobs import reference_weights, regression_job
from tests.threads import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[2]
OK, USER, OOM, NAN = (float(v) for v in (Vote.OK, Vote.USER_ERROR, Vote.OUT_OF_MEMORY, Vote.NONFINITE))


# --- verdict ---------------------------------------------------------------------------------


def test_a_step_nobody_voted_down_commits():
    assert verdict(7, (OK, OK, OK), "stop", None) == Commit()


def test_a_user_error_outranks_out_of_memory_and_non_finite_votes():
    assert verdict(7, (OOM, USER, NAN, USER), "skip", "tb") == UserFailure(step=7, ranks=(1, 3),
                                                                           traceback="tb")


def test_out_of_memory_names_every_rank_that_voted_down():
    assert verdict(7, (OK, OOM, NAN), "skip", None) == OutOfMemory(step=7, ranks=(1, 2))


def test_non_finite_votes_alone_stop_the_run_or_skip_the_update_as_the_policy_says():
    assert verdict(7, (NAN, OK, NAN), "stop", None) == NonFinite(step=7, ranks=(0, 2))
    assert verdict(7, (NAN, OK, NAN), "skip", None) == Commit(skipped=(0, 2))


# --- metadata and the flat reduce ------------------------------------------------------------


def _context(rank: int, world: int, plan: BatchPlan, indices: list[int], ledger: bool) -> StepContext:
    comm = SimpleNamespace(rank=rank, world_size=world)
    return StepContext(step=0, epoch=0, plan=plan, comm=comm,
                       indices=torch.tensor(indices), chaos=(), lr_factor=1.0, ledger=ledger,
                       started=0.0, wall_start=0.0)


def test_the_summed_metadata_holds_the_loss_every_vote_and_the_whole_ledger():
    plan = BatchPlan(5, (2, 0, 3), (2, 1, 3))
    shares = [[40, 41], [], [7, 8, 9]]
    votes = [Vote.OK, Vote.OK, Vote.OUT_OF_MEMORY]
    parts = [pack_meta(_context(r, 3, plan, shares[r], True), 0.5 * (r + 1), votes[r])
             for r in range(3)]
    assert all(len(p) == _context(0, 3, plan, [], True).meta_len for p in parts)
    reduced = Reduced.unpack(sum(parts), _context(0, 3, plan, [], True), None, 0.0)
    assert reduced.loss == 3.0
    assert reduced.votes == (OK, OK, OOM)
    assert reduced.indices == (40, 41, 7, 8, 9)
    short = _context(0, 3, plan, [], False)
    assert Reduced.unpack(parts[0][: short.meta_len], short, None, 0.0).indices is None


def test_one_yielding_rank_makes_every_rank_read_the_yield_and_the_rest_unchanged():
    plan = BatchPlan(5, (2, 0, 3), (2, 1, 3))
    shares = [[40, 41], [], [7, 8, 9]]
    forms = [LossForm.SUM, LossForm.NONE, LossForm.SUM]

    def reduced(yielding):
        parts = [pack_meta(_context(r, 3, plan, shares[r], True), 1.0, Vote.OK, 2.0, forms[r],
                           yielding=yielding[r]) for r in range(3)]
        return Reduced.unpack(sum(parts), _context(1, 3, plan, [], True), None, 0.0)

    calm, asked = reduced([False] * 3), reduced([False, False, True])
    assert (calm.yielded, asked.yielded) == (False, True)
    for r in (calm, asked):  # the yield slot moves nothing else
        assert (r.loss, r.count, r.indices) == (3.0 / 6.0, 6.0, (40, 41, 7, 8, 9))
        assert r.forms == tuple(float(f) for f in forms) and r.votes == (OK, OK, OK)


class _RecordingComm:
    """Sums nothing (one rank); records the collectives issued."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.dtype, int]] = []
        self.control = self

    def allreduce(self, tensor: torch.Tensor) -> None:
        self.calls.append((tensor.dtype, tensor.numel()))


def _params(*dtypes: torch.dtype) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.arange(3 + i, dtype=d)) for i, d in enumerate(dtypes)]
    for p in params:
        p.grad = p.detach() * 2
    return params


def test_flat_buffers_round_trip_and_a_down_vote_sends_zeros():
    params = _params(torch.float64, torch.float32, torch.float64)
    buffers = flatten_grads(params, zero=False)
    assert {d: b.numel() for d, b in buffers.items()} == {torch.float64: 8, torch.float32: 4}
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    unflatten_grads(params, buffers)
    for p, g in zip(params, expected, strict=True):
        assert torch.equal(p.grad, g)
    assert all(not b.any() for b in flatten_grads(params, zero=True).values())
    assert all_finite(buffers)
    buffers[torch.float32][1] = float("inf")
    assert not all_finite(buffers)


@pytest.mark.parametrize(("dtypes", "calls"), [
    ((torch.float32, torch.float64), [(torch.float64, 4 + 5), (torch.float32, 3)]),
    ((torch.float32,), [(torch.float32, 3 + 5)]),
    ((torch.bfloat16,), [(torch.float64, 5), (torch.bfloat16, 3)]),
])
def test_the_metadata_rides_in_the_widest_float_buffer(dtypes, calls):
    comm = _RecordingComm()
    meta = torch.arange(5, dtype=torch.float64)
    allreduce_flat(comm, flatten_grads(_params(*dtypes), zero=False), meta)
    assert comm.calls == calls
    assert torch.equal(meta, torch.arange(5, dtype=torch.float64))


# --- whole steps, ranks as threads -----------------------------------------------------------

B = 16


def _run(tmp_path, world: int, overlap: bool, steps: int, chaos: tuple[ChaosEvent, ...] = ()):
    config = FitConfig(
        scaling=ScalingConfig(num_workers=world, min_workers=1),
        collective=CollectiveConfig(overlap=overlap, bucket_bytes=1024, first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=steps, ledger=True)
    plan = BatchPlan(B, (9, 7) if world == 2 else (B,), (4, 3) if world == 2 else (3,))
    building = threading.Lock()  # the model is built under the process-wide torch seed

    def body(comm):
        with building:
            replica = Replica(regression_job(), config, str(tmp_path))
        replica.comm = comm
        replica.sync_from(0)
        outcomes = []
        pending = [e for e in chaos if e.rank == comm.rank]  # each fault fires once
        for _ in range(steps):
            mine = [e for e in pending if e.step == replica.global_step]
            pending = [e for e in pending if e not in mine]
            outcomes.append(replica.run_step(plan, mine))
        return outcomes, replica

    server = RendezvousServer()
    try:
        return run_ranks(server, world, body)
    finally:
        server.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_steps_with_accumulation_on_two_ranks_match_one_plain_process(tmp_path, overlap):
    results = _run(tmp_path, 2, overlap, 6)
    reference = reference_weights(0, B, 6)
    for outcomes, replica in results:
        assert all(isinstance(o, StepRecord) for o in outcomes)
        assert [o.step for o in outcomes] == list(range(6))
        torch.testing.assert_close(replica.model.state_dict(), reference, rtol=1e-9, atol=1e-10)
    assert len(set(results[0][0][2].indices)) == B


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_a_user_error_is_latched_into_the_vote_and_the_step_redone(tmp_path, overlap):
    chaos = (ChaosEvent(step=1, rank=1, action="raise", phase="backward"),)
    results = _run(tmp_path, 2, overlap, 4, chaos)
    (first, replica0), (second, replica1) = results
    assert first[1] == UserFailure(step=1, ranks=(1,), traceback=None)
    assert isinstance(second[1], UserFailure) and "InjectedFault" in second[1].traceback
    assert [o.step for o in first] == [0, 1, 1, 2]
    for replica in (replica0, replica1):
        assert replica.global_step == 3
        assert all(p.grad is None for p in replica.model.parameters())
        torch.testing.assert_close(replica.model.state_dict(), reference_weights(0, B, 3),
                                   rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_fault_fires_once_in_a_step_of_several_micro_batches(tmp_path, monkeypatch, phase):
    # Rank 0's share of 9 runs as micro-batches of 4, 4 and 1: a preemption notice sent once
    # per micro-batch would be a second SIGTERM, which ends the worker (a flake seen in CI).
    sent = []
    real = os.kill

    def kill(pid, sig):  # probes (signal 0: is a segment's owner alive?) go through
        if sig:
            sent.append(sig)
        else:
            real(pid, sig)

    monkeypatch.setattr("os.kill", kill)
    results = _run(tmp_path, 2, True, 3, (ChaosEvent(step=1, rank=0, action="preempt",
                                                     phase=phase),))
    assert sent == [signal.SIGTERM]
    for outcomes, replica in results:
        assert [o.step for o in outcomes] == [0, 1, 2]
        torch.testing.assert_close(replica.model.state_dict(), reference_weights(0, B, 3),
                                   rtol=1e-9, atol=1e-10)


# --- shape -----------------------------------------------------------------------------------


def test_no_function_in_the_step_is_longer_than_60_lines():
    long = []
    for path in sorted((ROOT / "elastic" / "trainer").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
