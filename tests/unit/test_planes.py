"""Which tensors go to which plane when the data plane is NCCL (the CPU simulator here).

The data plane (NCCL) may carry the model's gradients and nothing else; everything built on
the host (the votes, loss and ledger of a step, the peer-restore size and bytes, barriers,
metric names, evaluation sums) goes over the control plane. A recording transport wraps each
plane's transport and the test compares what each saw with what the step must send.
"""

from __future__ import annotations

import threading

import pytest
import torch

from elastic import BatchConfig, FitConfig, ScalingConfig
from elastic.adapt.plan import BatchPlan
from elastic.collective import RendezvousServer, nccl_sim
from elastic.collective import communicator as communicator_module
from elastic.collective.transport import Transport
from elastic.config import CollectiveConfig
from elastic.trainer import buckets as buckets_module
from elastic.trainer.replica import Replica, StepRecord
from tests.jobs import reference_run, reference_weights, regression_job, wide_job
from tests.threads import run_ranks

pytestmark = pytest.mark.timeout(120)

B = 16
N_PARAMS = 6 * 8 + 8 + 8 + 1  # tests.jobs.make_model


class Recording(Transport):
    """Forwards to a transport and records (operation, dtype, elements) of what it is given."""

    def __init__(self, inner: Transport, log: list[tuple[str, torch.dtype, int]]) -> None:
        self.inner, self.log = inner, log
        self.rank, self.world_size, self.name = inner.rank, inner.world_size, inner.name

    def exchange(self, sends, recvs, tag):
        self.log.extend(("send", t.dtype, t.numel()) for t, _ in sends)
        self.log.extend(("recv", t.dtype, t.numel()) for t, _ in recvs)
        return self.inner.exchange(sends, recvs, tag)

    def recv_reduce(self, tensor, src, op, tag, scratch=None):
        self.log.append(("recv_reduce", tensor.dtype, tensor.numel()))
        return self.inner.recv_reduce(tensor, src, op, tag, scratch)

    def allreduce(self, tensor, op):
        self.log.append(("allreduce", tensor.dtype, tensor.numel()))
        return self.inner.allreduce(tensor, op)

    def broadcast(self, tensor, src):
        self.log.append(("broadcast", tensor.dtype, tensor.numel()))
        return self.inner.broadcast(tensor, src)

    def abort(self):
        self.inner.abort()

    def close(self):
        self.inner.close()

    def fail(self):
        self.inner.fail()

    def host_group(self):
        return None  # no direct allreduce around the recorder: every byte goes through it


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
def test_only_gradients_reach_the_nccl_plane(tmp_path, monkeypatch, overlap):
    logs: dict[tuple[int, str], list] = {}
    make = communicator_module._make_transports

    def recording(config, rank, world_size, store, address, *rest):
        data, control = make(config, rank, world_size, store, address, *rest)
        assert data.name == "nccl" and control is not None and control.name != "nccl"
        return (Recording(data, logs.setdefault((rank, "data"), [])),
                Recording(control, logs.setdefault((rank, "control"), [])))

    monkeypatch.setattr(communicator_module, "_make_transports", recording)
    steps = 3
    config = FitConfig(
        scaling=ScalingConfig(num_workers=2, min_workers=1),
        collective=CollectiveConfig(backend="nccl", nccl_simulator=True, overlap=overlap),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=steps, ledger=True)
    plan = BatchPlan(B, (9, 7), (4, 3))
    building = threading.Lock()  # the model is built under the process-wide torch seed
    meta_lengths: list[int] = []

    def body(comm):
        assert comm.transport == "nccl" and comm.control is not comm
        with building:
            replica = Replica(regression_job(), config, str(tmp_path))
        replica.comm = comm
        replica.sync_from(0)  # the peer restore
        comm.barrier()
        outcomes = [replica.run_step(plan, []) for _ in range(steps)]
        return outcomes, replica

    server = RendezvousServer()
    try:
        results = run_ranks(server, 2, body, CollectiveConfig(backend="nccl", nccl_simulator=True))
    finally:
        server.close()
    reference = reference_weights(0, B, steps)
    for outcomes, replica in results:
        assert all(isinstance(o, StepRecord) for o in outcomes)
        torch.testing.assert_close(replica.model.state_dict(), reference, rtol=1e-9, atol=1e-10)
    for rank in (0, 1):
        data, control = logs[(rank, "data")], logs[(rank, "control")]
        # The data plane: one allreduce of the float64 gradients per step ('native', the
        # default with nccl), nothing else.
        assert data == [("allreduce", torch.float64, N_PARAMS)] * steps
        # The control plane: the restore's size and bytes, the barrier, then each step's
        # metadata (float64; 'ring' here, as the recorder offers no shared memory for 'direct':
        # each rank sends and receives the whole metadata once per step).
        assert control[0] == ("broadcast", torch.int64, 1)
        assert control[1][:2] == ("broadcast", torch.uint8) and control[1][2] > 1000
        assert control[2] == ("allreduce", torch.float32, 1)  # the barrier
        rest = control[3:]
        assert {dtype for _, dtype, _ in rest} == {torch.float64}
        sent = sum(n for op, _, n in rest if op == "send")
        received = sum(n for op, _, n in rest if op in ("recv", "recv_reduce"))
        assert sent == received and sent % steps == 0
        meta_lengths.append(sent // steps)
    assert meta_lengths[0] == meta_lengths[1] and meta_lengths[0] > B  # the ledger rides along


class Gated(Recording):
    """Holds this rank's NCCL stream behind a gate from its first allreduce on, and opens the
    gate when its `opens`-th allreduce is issued; records, at each issue, whether the first
    one had finished."""

    def __init__(self, inner: Transport, log: list, opens: int) -> None:
        super().__init__(inner, log)
        self.opens, self.gate, self.held = opens, threading.Event(), []
        self.first: list = []
        self.first_done: list[bool] = []  # at each issue

    def allreduce(self, tensor, op):
        if not self.log:
            def hold():  # a kernel on the NCCL stream, ahead of the step's first collective
                self.held.append(self.gate.wait(30))
            nccl_sim.launch(hold, on=self.inner._stream)
        self.first_done.append(bool(self.first) and all(h.is_done() for h in self.first))
        pending = super().allreduce(tensor, op)
        self.first = self.first or pending
        if len(self.log) == self.opens:
            self.gate.set()
        return pending


def test_nccl_buckets_go_out_without_waiting_for_the_one_before(tmp_path, monkeypatch):
    config = FitConfig(
        scaling=ScalingConfig(num_workers=2, min_workers=1),
        collective=CollectiveConfig(backend="nccl", nccl_simulator=True, overlap=True,
                                    bucket_bytes=1024, first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=1)
    job = wide_job()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        counting = Replica(job, config, str(tmp_path))  # how many buckets it sums in
        buckets = len(counting.reducer.buckets.buckets)
        counting.close()
    running = buckets_module._RUNNING  # started and not finished, at most
    assert buckets >= running + 1
    gated: list[Gated] = []
    make = communicator_module._make_transports

    def gating(config, rank, world_size, store, address, *rest):
        data, control = make(config, rank, world_size, store, address, *rest)
        if rank == 0:  # the gate opens once every bucket the cap allows has gone out
            gated.append(Gated(data, [], running))
            return gated[-1], control
        return data, control

    monkeypatch.setattr(communicator_module, "_make_transports", gating)
    building = threading.Lock()

    def body(comm):
        with building:
            replica = Replica(job, config, str(tmp_path))
        replica.comm = comm
        replica.sync_from(0)
        comm.barrier()
        return replica.run_step(BatchPlan(B, (9, 7), (4, 3)), []), replica

    server = RendezvousServer()
    try:
        results = run_ranks(server, 2, body, CollectiveConfig(backend="nccl", nccl_simulator=True))
    finally:
        server.close()
    (gate,) = gated
    assert gate.held == [True]  # opened by an issue, not by the timeout
    assert [op for op, _, _ in gate.log] == ["allreduce"] * buckets
    # Buckets 2 to `running` went out while the first could not finish; the next one only
    # once the first had finished (the cap).
    assert gate.first_done[:running] == [False] * running
    assert gate.first_done[running] is True
    reference = reference_run(job, 0, [B])
    for outcome, replica in results:
        assert isinstance(outcome, StepRecord)
        torch.testing.assert_close(replica.model.state_dict(), reference, rtol=1e-9, atol=1e-10)
        replica.close()


@pytest.mark.parametrize("config, started", [
    (CollectiveConfig(), False),
    (CollectiveConfig(backend="nccl", nccl_simulator=True, algorithm="ring"), False),
    (CollectiveConfig(backend="nccl", nccl_simulator=True), True),
], ids=["cpu", "nccl-ring", "nccl"])
def test_only_nccl_starts_an_allreduce_that_the_host_does_not_run(config, started):
    def body(comm):
        t = torch.full((4,), float(comm.rank + 1), dtype=torch.float64)
        handles = comm.start_allreduce(t)
        if handles is None:
            return None
        with pytest.raises(ValueError, match="contiguous"):
            comm.start_allreduce(torch.zeros(4, 2, dtype=torch.float64).t())
        comm.wait(handles)
        return t

    server = RendezvousServer()
    try:
        results = run_ranks(server, 2, body, config)
    finally:
        server.close()
    if started:
        assert all(torch.equal(t, torch.full((4,), 3.0, dtype=torch.float64)) for t in results)
    else:
        assert results == [None, None]
