"""Sharded optimizer state (stages 1 and 2) in the step, ranks as threads of the test process
(no Ray): the weights of a plain single-process loop and of stage 0, through generations that
lose ranks and take fresh ones; each rank holds the state (and at stage 2 the summed gradients)
of the parameters it owns only; exact mode bit-identical to stage 0; a part whose every owner
was lost is named."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from elastic import BatchConfig, FitConfig, ScalingConfig, ShardingConfig, TrainJob
from elastic.adapt.plan import plan_batch
from elastic.collective import Communicator, RendezvousServer
from elastic.config import CollectiveConfig, TrainingConfig
from elastic.errors import CollectiveError, ConfigError
from elastic.trainer import apply as apply_module
from elastic.trainer import sharding as sharding_module
from elastic.trainer.replica import Replica, StepRecord
from tests import sharding
from tests.sharding import adamw as _adamw
from tests.sharding import job as _job
from tests.sharding import reference as _reference
from tests.sharding import sgd as _sgd
from tests.threads import run_ranks

B, N, SEED = sharding.B, sharding.N, sharding.SEED


def _config(tmp_path, stage: int, replicas: int = 2, exact: bool = False) -> FitConfig:
    return FitConfig(scaling=ScalingConfig(num_workers=4, min_workers=1),
                     batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False,
                                       exact=exact, groups="on" if exact else "auto",
                                       group_size=6 if exact else None),
                     training=TrainingConfig(clip_grad_norm=0.5),
                     sharding=ShardingConfig(stage=stage, replicas=replicas),
                     # stage 2: buckets of 1 KB, so that the small model's gradients take several
                     collective=CollectiveConfig(bucket_bytes=1024, first_bucket_bytes=1024),
                     run_dir=str(tmp_path), max_steps=100, seed=SEED)


_building = threading.Lock()  # models are built under the process-wide seed


def _run(tmp_path, job: TrainJob, config: FitConfig, schedule, unit: int = 1,
         chaos=None, make=Replica, comm: CollectiveConfig | None = None) -> dict[str, Replica]:
    """Runs `schedule`, a list of (members, steps): each a new generation of the replicas
    named by `members` (a new name is a fresh replica; a name left out is a lost one), which
    forms as the controller forms one (every rank syncs from the newest step's lowest rank)
    and runs `steps` steps. Every member holds the same parameters after every step. Returns
    the replicas by name."""
    replicas: dict[str, Replica] = {}
    server = RendezvousServer()
    try:
        for members, steps in schedule:
            for name in members:
                if name not in replicas:
                    with _building:
                        replicas[name] = make(job, config, str(tmp_path))
            world = len(members)
            held = [replicas[name].restorable_step for name in members]
            src = max(range(world), key=lambda r: (held[r], -r))
            plan = plan_batch(B, world, unit if unit > 1 else None, unit=unit)

            def body(comm, members=members, steps=steps, src=src, plan=plan):
                replica = replicas[members[comm.rank]]
                replica.comm = comm
                replica.sync_from(src)
                params = []
                for _ in range(steps):
                    assert isinstance(replica.run_step(plan, []), StepRecord)
                    params.append([p.detach().clone() for p in replica.model.parameters()])
                return params

            results = run_ranks(server, world, body, comm)
            for per_rank in zip(*results, strict=True):  # every member, every step: same bits
                for other in per_rank[1:]:
                    assert all(torch.equal(a, b) for a, b in zip(other, per_rank[0], strict=True))
    finally:
        server.close()
        for replica in replicas.values():
            replica.close()
    return replicas


def _state_tensors(replica: Replica) -> int:
    """Elements of optimizer state this replica holds."""
    return sum(v.numel() for st in replica.optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.ndim > 0)


SCHEDULE = [(["a", "b", "c", "d"], 3),  # four workers
            (["a", "c", "d"], 2),  # "b" lost: its parts come from their other owners
            (["a", "c", "d", "e"], 2),  # "e" joins with nothing: it takes a fair share
            (["e", "d"], 2)]  # two lost at once: r=2 still leaves a copy of every part


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer", [_adamw, _sgd], ids=["adamw_groups", "sgd_momentum"])
def test_sharded_stages_end_with_the_weights_of_one_plain_process_through_losses_and_joins(
        tmp_path, optimizer, stage):
    replicas = _run(tmp_path, _job(optimizer), _config(tmp_path, stage=stage), SCHEDULE)
    final = replicas["e"].model.state_dict()
    expected = _reference(optimizer, 9)
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)
    # Each survivor holds only the parts it owns; together they hold every part twice.
    whole = sum(p.numel() for p in replicas["e"].model.parameters()) * (
        2 if optimizer is _adamw else 1)
    held = [_state_tensors(replicas[name]) for name in ("e", "d")]
    assert sum(held) == 2 * whole  # two owners of every part, two ranks: each holds all
    owned = replicas["e"].shards.owned | replicas["d"].shards.owned
    assert owned == set(range(len(list(replicas["e"].model.parameters()))))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_stages_over_nccl_end_with_the_weights_of_one_plain_process(tmp_path,
                                                                            monkeypatch, stage):
    """Over NCCL (the simulator) the buckets' allreduces and the gather's windows are only
    started and finished in order: each rank still takes its share of every sum, and every
    part's values, once they are done. The gather's windows: two at a time, the older one
    finished before a third starts; a part larger than a window alone, beside at most one
    window after it."""
    monkeypatch.setattr(sharding_module, "_GATHER_ELEMENTS", 64)  # several windows
    log: list[tuple[str, int]] = []  # (call, elements) of rank 0's gather, in order
    start, wait = Communicator.start_allreduce, Communicator.wait
    in_gather = threading.local()

    def recorded_start(self, tensor):
        handles = start(self, tensor)
        if self.rank == 0 and getattr(in_gather, "on", False) and tensor.numel():
            log.append(("start", tensor.numel()))
            in_gather.handles[id(handles)] = tensor.numel()
        return handles

    def recorded_wait(self, pending):
        if self.rank == 0 and getattr(in_gather, "on", False) and id(pending) in in_gather.handles:
            log.append(("wait", in_gather.handles.pop(id(pending))))
        return wait(self, pending)

    take = sharding_module.OptimizerShards.gather

    def gather(self, comm, streams):
        in_gather.on, in_gather.handles = True, {}
        try:
            return take(self, comm, streams)
        finally:
            in_gather.on = False

    monkeypatch.setattr(Communicator, "start_allreduce", recorded_start)
    monkeypatch.setattr(Communicator, "wait", recorded_wait)
    monkeypatch.setattr(sharding_module.OptimizerShards, "gather", gather)
    nccl = CollectiveConfig(backend="nccl", nccl_simulator=True, bucket_bytes=1024,
                            first_bucket_bytes=1024)
    config = _config(tmp_path, stage=stage).model_copy(update={"collective": nccl})
    replicas = _run(tmp_path, _job(), config, SCHEDULE[:2], comm=nccl)
    expected = _reference(_adamw, 5)
    final = replicas["a"].model.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)
    # Per gather: start, start, then each later start after the oldest one's wait.
    calls = [c for c, _ in log]
    assert calls[:3] == ["start", "start", "wait"] and calls.count("start") > 10
    running = level = peak = 0
    for call, n in log:
        running += 1 if call == "start" else -1
        level += n if call == "start" else -n
        peak = max(peak, level)
        assert 0 <= running <= 2
    largest = max(p.numel() for p in replicas["a"].model.parameters())
    assert largest > 64 and peak <= largest + 64  # not two large parts at once


@pytest.mark.timeout(120)
def test_a_rank_holds_the_state_of_its_parts_only(tmp_path):
    replicas = _run(tmp_path, _job(), _config(tmp_path, stage=1), SCHEDULE[:1])
    whole = 2 * sum(p.numel() for p in replicas["a"].model.parameters())  # AdamW: m and v
    held = {name: _state_tensors(r) for name, r in replicas.items()}
    assert sum(held.values()) == 2 * whole  # every part on two of the four ranks
    assert max(held.values()) < whole  # nobody holds everything
    for replica in replicas.values():
        params = list(replica.model.parameters())
        with_state = {i for i, p in enumerate(params) if p in replica.optimizer.state}
        assert with_state == set(replica.shards.owned)


@pytest.mark.timeout(120)
def test_stage_1_matches_stage_0_and_one_replica_per_part_works(tmp_path):
    sharded = _run(tmp_path, _job(), _config(tmp_path, stage=1, replicas=1),
                   [(["a", "b", "c"], 4)])
    whole = _run(tmp_path, _job(), _config(tmp_path, stage=0), [(["a", "b", "c"], 4)])
    for x, y in zip(sharded["a"].model.parameters(), whole["a"].model.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(120)
def test_exact_mode_with_sharding_is_bit_identical_to_stage_0_across_world_sizes(tmp_path):
    schedule = [(["a", "b", "c", "d"], 2), (["a", "c", "d"], 2), (["c", "e", "d", "a"], 2)]
    sharded = _run(tmp_path, _job(), _config(tmp_path, stage=1, exact=True), schedule, unit=6)
    plain = _run(tmp_path, _job(), _config(tmp_path, stage=0, exact=True),
                 [(["x"], 6)], unit=6)
    for x, y in zip(sharded["e"].model.parameters(), plain["x"].model.parameters(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.timeout(120)
def test_losing_every_owner_of_a_part_is_named_not_papered_over(tmp_path):
    replicas = _run(tmp_path, _job(), _config(tmp_path, stage=1, replicas=1),
                    [(["a", "b", "c"], 2)])
    lost = sorted(replicas["b"].shards.owned)
    server = RendezvousServer()
    try:
        def body(comm):
            replica = replicas[["a", "c"][comm.rank]]
            replica.comm = comm
            replica.sync_from(0)

        with pytest.raises(CollectiveError, match="every owner of them was lost") as raised:
            run_ranks(server, 2, body)
        assert f"#{lost[0]}" in str(raised.value)
    finally:
        server.close()


def test_an_optimizer_that_is_not_per_parameter_is_refused(tmp_path):
    job = TrainJob(model=sharding.model, optimizer=lambda params: torch.optim.LBFGS(params),
                   loss=sharding.mse, dataset=sharding.data)
    with pytest.raises(ConfigError, match=r"sharding\.stage=0"):
        Replica(job, _config(tmp_path, stage=1), str(tmp_path))


class _GlobalNormSGD(torch.optim.SGD):
    """SGD that first clips by the norm of every gradient it steps, as timm's and apex's LAMB
    do by default (`max_grad_norm`)."""

    def __init__(self, params, lr=0.1, max_grad_norm=1.0):
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group["max_grad_norm"] = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        limit = self.param_groups[0]["max_grad_norm"]
        if limit > 0:
            torch.nn.utils.clip_grads_with_norm_(
                [p for g in self.param_groups for p in g["params"]], limit,
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads])))
        return super().step(closure)


def test_an_optimizer_that_clips_by_the_norm_of_every_gradient_is_refused(tmp_path):
    # Before: each owner clipped by the norm of its own parts, silently (other weights than
    # stage 0, and the owners of a part parted ways).
    job = TrainJob(model=sharding.model, optimizer=lambda params: _GlobalNormSGD(params),
                   loss=sharding.mse, dataset=sharding.data)
    with pytest.raises(ConfigError) as refused:
        Replica(job, _config(tmp_path, stage=1), str(tmp_path))
    assert str(refused.value) == (
        "sharding.stage 1 steps each parameter on its owners only, but _GlobalNormSGD clips by "
        "the norm of all the gradients it steps (max_grad_norm = 1.0): each owner would see "
        "only its own parts. Give the optimizer max_grad_norm=0 and set "
        "training.clip_grad_norm instead (computed over every gradient), or set "
        "sharding.stage=0")
    unclipped = TrainJob(model=sharding.model, loss=sharding.mse, dataset=sharding.data,
                         optimizer=lambda params: _GlobalNormSGD(params, max_grad_norm=0.0))
    Replica(unclipped, _config(tmp_path, stage=1), str(tmp_path)).close()


def test_a_fresh_worker_takes_larger_optimizer_state_when_the_setting_allows_it(tmp_path):
    # A preconditioner optimizer (SOAP on a 4096 x 1024 weight: about 40 bytes of state per
    # element) was refused whenever its state moved to a fresh worker, and the error named
    # nothing to change.
    from elastic.trainer.sharding import _state_bound

    params = [torch.nn.Parameter(torch.empty(4096, 1024, device="meta"))]
    soap = 40 * 4096 * 1024
    assert _state_bound(params, [0], {}) < soap <= _state_bound(params, [0], {}, 64)
    config = _config(tmp_path, stage=1).model_copy(
        update={"sharding": ShardingConfig(stage=1, max_state_bytes_per_element=64)})
    job = TrainJob(model=sharding.model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                   loss=sharding.mse, dataset=sharding.data)
    replica = Replica(job, config, str(tmp_path))
    assert replica.shards.state_bytes == 64
    replica.close()


def test_replicas_above_the_workers_are_refused():
    with pytest.raises(ValueError, match=r"sharding\.replicas \(3\) exceeds scaling\.num_workers \(2\)"):
        FitConfig(scaling=ScalingConfig(num_workers=2), batch=BatchConfig(global_batch_size=8),
                  max_steps=1, sharding=ShardingConfig(stage=1, replicas=3))


def test_the_memory_probe_counts_the_state_the_gradients_and_the_parameters(tmp_path):
    from elastic.bench.memory import MemoryProbe

    model = sharding.model()
    optimizer = sharding.adamw(model)
    probe = MemoryProbe(str(tmp_path), model, optimizer)
    params = list(model.parameters())
    sharding.mse(model, sharding.data()[:8]).backward()
    params[0].grad = None  # a part this rank does not own
    optimizer.step()
    probe.after_step(model)
    (figures,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    stepped = sum(p.numel() for p in params[1:]) * 4
    assert figures["gradient_bytes"] == stepped
    assert figures["optimizer_state_bytes"] == 2 * stepped + 4 * (len(params) - 1)  # m, v, step
    assert figures["parameter_bytes"] == sum(p.numel() for p in params) * 4
    assert figures["peak_rss_bytes"] > 0


def test_a_failed_attempt_to_form_keeps_the_parts_for_the_next(tmp_path):
    replicas = _run(tmp_path, _job(), _config(tmp_path, stage=1), [(["a", "b"], 2)])
    shards = replicas["a"].shards
    before = {part: {k: v.clone() for k, v in st.items()} for part, st in shards.keep(True).items()}
    assert before and set(before) == set(shards.owned)
    optimizer = replicas["a"].optimizer
    # The source's replicated state empties the optimizer; then the attempt fails.
    optimizer.load_state_dict({**optimizer.state_dict(), "state": {}})
    again = shards.keep(True)
    assert set(again) == set(before)
    for part, state in before.items():
        assert all(torch.equal(state[k], again[part][k]) for k in state)
    assert shards.keep(False) == {} and shards.held == frozenset()  # a step behind: none


@pytest.mark.timeout(120)
def test_a_world_below_the_replicas_owns_every_part_on_every_rank(tmp_path):
    replicas = _run(tmp_path, _job(), _config(tmp_path, stage=1, replicas=3),
                    [(["a", "b", "c", "d"], 2), (["a", "b"], 2), (["b"], 2)])
    parts = set(range(len(list(replicas["b"].model.parameters()))))
    assert replicas["b"].shards.owned == parts
    assert replicas["b"].shards.ownership.owners == tuple((0,) for _ in parts)
    final = replicas["b"].model.state_dict()
    for key, value in _reference(_adamw, 6).items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.timeout(120)
def test_a_world_no_larger_than_the_replicas_gathers_nothing_after_a_step(tmp_path, monkeypatch):
    # Every rank owns every part and stepped it itself, as in stage 0. Before, the gather
    # summed the whole model once more every step (default replicas 2 on 2 workers).
    from elastic.trainer import sharding as module

    summed: list[int] = []
    gather = module.OptimizerShards.gather

    def counted(self, comm, streams):
        calls = []
        take = self._take_from
        self._take_from = lambda comm, sources, streams: (calls.append(sources),
                                                          take(comm, sources, streams))
        try:
            gather(self, comm, streams)
        finally:
            del self._take_from
        summed.append(sum(source is not None for source in calls[0]))

    monkeypatch.setattr(module.OptimizerShards, "gather", counted)
    replicas = _run(tmp_path, _job(), _config(tmp_path, stage=1),
                    [(["a", "b", "c"], 2), (["a", "b"], 2)])
    parts = len(list(replicas["b"].model.parameters()))
    assert summed[:6] == [parts] * 6 and summed[6:] == [0] * 4  # 3 ranks: 2 steps; then none
    final = replicas["b"].model.state_dict()
    for key, value in _reference(_adamw, 4).items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)


class _Unsure(Replica):
    """A peer dies in the agreement before step `at`, as seen by each rank: on an `unsure`
    one the agreement fails (it holds the sums unapplied); the others apply the step and
    their gather fails (the peer is gone)."""

    at, unsure = -1, False


def _agree_then_fail(host, context, computed, reduced, commit, agree=apply_module.agree):
    agree(host, context, computed, reduced, commit)
    if context.step != host.at:
        return
    if host.unsure:
        apply_module.hold(host, context, computed, reduced, commit)
        raise CollectiveError("injected: the agreement failed here")
    gather = host.shards.gather

    def fail_once(comm, host_staged):
        host.shards.gather = gather
        raise CollectiveError("injected: a peer died in the gather")

    host.shards.gather = fail_once


def _generation(server, replicas, members, steps, src=None, leaving=()):
    """One generation of `members` (names in `replicas`) that syncs (the ranks in `leaving`
    handing their parts over) and runs `steps` steps; a rank whose step raises a collective
    error ends there."""
    world = len(members)
    held = [replicas[name].restorable_step for name in members]
    src = max(range(world), key=lambda r: (held[r], -r)) if src is None else src
    plan = plan_batch(B, world, None)

    def body(comm):
        replica = replicas[members[comm.rank]]
        replica.comm = comm
        replica.sync_from(src, leaving)
        for _ in range(steps):
            try:
                record = replica.run_step(plan, [])
            except CollectiveError:
                return
            if record.interrupted:  # as the worker ends its chunk
                return

    run_ranks(server, world, body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("everyone", [False, True], ids=["applied_by_peers", "applied_by_none"])
def test_a_step_held_unapplied_is_applied_or_dropped_as_the_next_generation_forms(
        tmp_path, monkeypatch, everyone, stage):
    monkeypatch.setattr(apply_module, "agree", _agree_then_fail)
    config = _config(tmp_path, stage=stage)
    replicas = {}
    for name in "abcd":
        with _building:
            replicas[name] = _Unsure(_job(), config, str(tmp_path))
        replicas[name].at, replicas[name].unsure = 2, everyone or name == "a"
    server = RendezvousServer()
    try:
        _generation(server, replicas, list("abcd"), 3)
        assert [replicas[n].restorable_step for n in "abcd"] == ([2] * 4 if everyone
                                                                 else [2, 3, 3, 3])
        for replica in replicas.values():
            replica.at = -1
        # The rank that shares parts with "a" is lost: those parts' only holder is "a",
        # whose step 2 is applied by it as the generation forms (or by nobody: then step 2
        # is redone).
        ownership = replicas["a"].shards.ownership
        partner = next(q for q in range(1, 4)
                       if any(set(o) == {0, q} for o in ownership.owners))
        members = ["a"] + [n for i, n in enumerate("bcd", 1) if i != partner]
        _generation(server, replicas, members, 3 if everyone else 2)
    finally:
        server.close()
        for replica in replicas.values():
            replica.close()
    final = replicas["a"].model.state_dict()
    assert replicas["a"].restorable_step == 5
    for key, value in _reference(_adamw, 5).items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_batchnorm_buffers_and_sharded_state_end_on_one_plain_process(tmp_path, stage):
    from tests import fidelity

    job = fidelity.cnn_job()
    config = FitConfig(scaling=ScalingConfig(num_workers=4, min_workers=1),
                       batch=BatchConfig(global_batch_size=24, group_size=6, autotune=False,
                                         rebalance=False),
                       sharding=ShardingConfig(stage=stage), run_dir=str(tmp_path),
                       max_steps=100, seed=3)
    replicas = _run(tmp_path, job, config, [(["a", "b", "c", "d"], 2), (["a", "c", "d"], 2),
                                            (["a", "c", "d", "e"], 2)], unit=6)
    final = replicas["e"].model.state_dict()
    for key, value in fidelity.reference(job, 3, 24, 6, 6).items():
        if value.dtype == torch.int64:
            assert torch.equal(final[key], value), key
        else:
            torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)


def test_a_checkpoint_loaded_drops_what_a_rank_kept_of_the_timeline_it_replaces(tmp_path):
    from elastic.trainer.sharding import PendingStep

    replicas = _run(tmp_path, _job(), _config(tmp_path, stage=1), [(["a", "b"], 1)])
    replica = replicas["a"]
    checkpoint = replica.state()
    dropped = []
    replica.shards.pending = PendingStep(2, lambda: pytest.fail("applied"), lambda: dropped.append(1))
    replica.unfinished = lambda: pytest.fail("a stale step's end ran")
    replica.load_state(checkpoint, origin="checkpoint")
    assert dropped == [1] and replica.shards.pending is None and replica.unfinished is None
    assert replica.shards.held == set(range(len(list(replica.model.parameters()))))


def test_each_part_is_written_once_by_its_first_owner(tmp_path):
    replicas = _run(tmp_path, _job(), _config(tmp_path, stage=1, replicas=2),
                    [(["a", "b", "c"], 2)])
    shards = [replicas[n].shards.primary_states() for n in "abc"]
    ids = [i for shard in shards for i in shard]
    expected = sharding.adamw(sharding.model())
    assert sorted(ids) == list(range(sum(len(g["params"]) for g in expected.param_groups)))
    for name, shard in zip("abc", shards, strict=True):  # each from the state it holds
        state = replicas[name].optimizer.state_dict()["state"]
        for i, value in shard.items():
            assert torch.equal(value["exp_avg"], state[i]["exp_avg"])


def test_a_dead_owners_parts_are_written_by_their_next_owner_and_a_lost_part_is_named(tmp_path):
    # A final checkpoint after a loss (before the next generation forms): the survivors'
    # shards still cover every part (before, parts whose first owner died were in none, so
    # the checkpoint was skipped; with the dead left out of the peers, it would have
    # committed without them).
    replicas = _run(tmp_path, _job(), _config(tmp_path, stage=1, replicas=2),
                    [(["a", "b", "c"], 2)])
    owners = replicas["a"].shards.ownership.owners
    for dead in range(3):
        alive = [n for r, n in enumerate("abc") if r != dead]
        shards = [replicas[n].shards.primary_states([dead]) for n in alive]
        ids = sorted(i for shard in shards for i in shard)
        assert ids == list(range(len(owners)))  # every part once, none twice
        assert replicas[alive[0]].shards.orphaned([dead]) == []
        assert any(owners[p][0] == dead for p in range(len(owners)))  # not a vacuous case
    lost = replicas["a"].shards.orphaned([0, 1])
    assert lost == [p for p, ranks in enumerate(owners) if set(ranks) <= {0, 1}] and lost


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stage", "precision"), [(1, "bf16-mixed"), (2, "bf16-mixed"),
                                                  (2, "fp16-mixed")])
def test_autocast_with_sharding_gives_the_weights_of_stage_0(tmp_path, stage, precision):
    def config(stage):
        return _config(tmp_path, stage=stage).model_copy(
            update={"training": TrainingConfig(clip_grad_norm=0.5, precision=precision)})

    schedule = [(["a", "b", "c", "d"], 2), (["a", "c", "d"], 2)]
    sharded = _run(tmp_path, _job(), config(stage), schedule)
    whole = _run(tmp_path, _job(), config(0), schedule)
    for x, y in zip(sharded["a"].model.parameters(), whole["a"].model.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


class _Watched(Replica):
    """Records, at each optimizer step, which parameters have a gradient, which this rank
    owns, and how many gradient buckets are still allocated; and each step's gradient norm."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seen: list[tuple[frozenset[int], frozenset[int], int]] = []
        self.norms: list[float | None] = []
        self.optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs) -> None:
        with_grad = frozenset(i for i, p in enumerate(self._params) if p.grad is not None)
        state = getattr(getattr(self.reducer, "buckets", None), "_state", None)
        held = sum(b is not None for b in state.buffers) if state is not None else -1
        owned = frozenset(self.shards.owned) if self.shards is not None else frozenset()
        self.seen.append((with_grad, owned, held))

    def run_step(self, *args, **kwargs):
        record = super().run_step(*args, **kwargs)
        self.norms.append(record.grad_norm)
        return record


@pytest.mark.timeout(120)
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_stage_2_keeps_the_summed_gradients_of_its_parts_only_and_clips_over_all(tmp_path, clip):
    training = (TrainingConfig(clip_grad_norm=0.05) if clip == "norm"
                else TrainingConfig(clip_grad_value=0.01))
    schedule = [(["a", "b", "c", "d"], 2), (["a", "c", "d"], 2)]

    def config(stage):
        return _config(tmp_path, stage=stage).model_copy(update={"training": training})

    sharded = _run(tmp_path, _job(), config(2), schedule, make=_Watched)
    whole = _run(tmp_path, _job(), config(0), schedule, make=_Watched)
    params = len(list(sharded["a"].model.parameters()))
    assert len(sharded["a"].reducer.buckets.buckets) >= 3
    for replica in sharded.values():
        assert replica.seen
        for with_grad, owned, buckets_held in replica.seen:
            assert with_grad == owned and 0 < len(owned) < params  # its share, no more
            assert buckets_held == 0  # every bucket freed by the optimizer step
    # the norm over all parameters, not over this rank's share, as in stage 0
    for name in "acd":
        torch.testing.assert_close(sharded[name].norms, whole[name].norms, rtol=1e-6, atol=0)
    for x, y in zip(sharded["a"].model.parameters(), whole["a"].model.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_stage_2_refuses_exact_mode_and_one_buffer_after_the_backward_pass():
    def config(**batch):
        return dict(scaling=ScalingConfig(num_workers=2), max_steps=1,
                    batch=BatchConfig(global_batch_size=8, **batch),
                    sharding=ShardingConfig(stage=2))

    with pytest.raises(ValueError, match=r"set sharding\.stage=1 .*or batch\.exact=False"):
        FitConfig(**config(exact=True, groups="on", group_size=4))
    with pytest.raises(ValueError, match=r"collective\.overlap=False .* set collective\.overlap=None"):
        FitConfig(**config(), collective=CollectiveConfig(overlap=False))
    FitConfig(**config(), collective=CollectiveConfig(overlap=True))


def _fresh(tmp_path, config: FitConfig, names: str) -> dict[str, Replica]:
    """A fresh replica per name in `names`."""
    replicas = {}
    for name in names:
        with _building:
            replicas[name] = Replica(_job(), config, str(tmp_path))
    return replicas


def _assert_plain(replica: Replica, steps: int) -> None:
    """`replica` holds `steps` committed steps and the plain loop's weights after them."""
    assert replica.restorable_step == steps
    final = replica.model.state_dict()
    for key, value in _reference(_adamw, steps).items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_leaver_with_the_only_copy_of_its_parts_hands_them_over_before_it_goes(tmp_path, stage):
    replicas = _fresh(tmp_path, _config(tmp_path, stage=stage, replicas=1), "abc")
    server = RendezvousServer()
    try:
        _generation(server, replicas, list("abc"), 2)
        only_b = replicas["b"].shards.owned
        assert only_b  # with one owner per part, "b" alone holds these
        _generation(server, replicas, list("abc"), 0, leaving=(1,))  # the hand-over
        assert replicas["b"].shards.owned == frozenset() and not replicas["b"].optimizer.state
        for part in only_b:
            assert part in replicas["a"].shards.owned | replicas["c"].shards.owned
        _generation(server, replicas, ["a", "c"], 2)  # without "b": nothing lost
    finally:
        server.close()
        for replica in replicas.values():
            replica.close()
    _assert_plain(replicas["a"], 4)


def _adafactor(model):
    return torch.optim.Adafactor(model.parameters(), lr=0.01)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_an_optimizer_with_factored_per_tensor_state_works_sharded(tmp_path, stage):
    # Adafactor keeps a matrix's second moment as a row and a column vector: not element-wise,
    # so flat slices of the parameters would break it; whole tensors keep it as it is.
    replicas = _run(tmp_path, _job(_adafactor), _config(tmp_path, stage=stage), SCHEDULE)
    final = replicas["e"].model.state_dict()
    for key, value in _reference(_adafactor, 9).items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)
    state = replicas["e"].optimizer.state_dict()["state"]
    assert any("row_var" in s for s in state.values())  # the factored moments moved whole


@pytest.mark.timeout(120)
def test_parts_received_in_a_failed_hand_over_are_kept_and_claimed(tmp_path, monkeypatch):
    from elastic.trainer import sharding as sharding_module

    replicas = _fresh(tmp_path, _config(tmp_path, stage=1, replicas=1), "abc")
    server = RendezvousServer()
    try:
        _generation(server, replicas, list("abc"), 2)
        only_c = replicas["c"].shards.owned
        real = sharding_module._all_received

        def fails(control):  # the leaver dies once every part reached its new owner
            raise CollectiveError("injected: a peer died before the last sum")

        monkeypatch.setattr(sharding_module, "_all_received", fails)
        with pytest.raises(CollectiveError, match="injected"):
            _generation(server, replicas, list("abc"), 0, leaving=(2,))
        for part in only_c:  # received, kept and claimed, though not installed
            assert part in replicas["a"].shards.held | replicas["b"].shards.held
        monkeypatch.setattr(sharding_module, "_all_received", real)
        _generation(server, replicas, ["a", "b"], 2)  # "c" is gone: nothing was lost with it
    finally:
        server.close()
        for replica in replicas.values():
            replica.close()
    _assert_plain(replicas["a"], 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_gpu_parameters_on_a_host_plane_are_gathered_in_host_memory_waited_for_once(
        tmp_path, monkeypatch, stage):
    """GPU workers sharing a GPU (host plane): the gather after each step and the values a
    generation takes go through page-locked host memory. The fake streams defer every copy
    from the GPU until the host waits for it (a copy's destination reads NaN until then), so
    a sum that read too early ends in NaN weights; the host waits once per window of parts,
    not once per part (before: a blocking copy per part); a generation of one rank moves
    nothing (before: every parameter copied out and summed with itself)."""
    from elastic.trainer import sharding as sharding_module
    from tests.unit.test_host_staging import DeferredStreams

    made: list[tuple[int, DeferredStreams]] = []

    def streams(device, comm):  # as on a GPU worker whose communicator is its own control
        made.append((comm.world_size, DeferredStreams()))
        return made[-1][1]

    monkeypatch.setattr(apply_module, "staged_streams", streams)
    monkeypatch.setattr(sharding_module, "staged_streams", streams)
    # One owner per part, nobody lost: two and three ranks gather (with `replicas` owners
    # each, a world no larger than that gathers nothing).
    schedule = [(["a"], 1), (["a", "b"], 2), (["a", "b", "d"], 2)]
    replicas = _run(tmp_path, _job(_sgd), _config(tmp_path, stage=stage, replicas=1), schedule)
    final = replicas["d"].model.state_dict()
    for key, value in _reference(_sgd, 5).items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)
    several = [fake for world, fake in made if world > 1]
    alone = [fake for world, fake in made if world == 1]
    assert len(several) == (2 + 3) * (1 + 2)  # per rank: each generation's take, its gathers
    assert all(fake.violations == [] for fake in several)
    # this model's parameters fit one window: one wait for the device per gather
    assert all([e[0] for e in fake.log].count("synchronize") == 1 for fake in several)
    assert len(alone) == 1 + 1 and all(fake.log == [] for fake in alone)


def test_a_sharded_checkpoint_stays_in_host_memory_until_each_rank_installs_its_own_parts(
        tmp_path, monkeypatch):
    """The worker that loads a checkpoint (its shards joined: the whole optimizer state) does
    not install it into its optimizer (on a GPU, every part's state on one device: the memory
    sharding exists to save); the state waits in host memory until the generation forms, and
    each rank installs the parts it owns only. The weights are those of one plain process."""
    first = _run(tmp_path / "a", _job(), _config(tmp_path / "a", stage=1, replicas=2),
                 [(["a", "b"], 2)])
    checkpoint = first["a"].state()  # two ranks, two replicas: "a" holds every part
    assert len(checkpoint["optimizer"]["state"]) == len(list(first["a"].model.parameters()))
    installed: dict[int, list[int]] = {}
    load = torch.optim.Optimizer.load_state_dict

    def spy(self, state_dict):
        installed.setdefault(id(self), []).append(len(state_dict["state"]))
        return load(self, state_dict)

    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", spy)
    loaded: list[Replica] = []

    def make(job, config, run_dir):
        replica = Replica(job, config, run_dir)
        if not loaded:
            replica.load_state(checkpoint, origin="checkpoint")
            assert _state_tensors(replica) == 0  # in host memory, not the optimizer's
            loaded.append(replica)
        return replica

    replicas = _run(tmp_path / "c", _job(), _config(tmp_path / "c", stage=1, replicas=1),
                    [(["c", "d"], 2)], make=make)
    final = replicas["d"].model.state_dict()
    for key, value in _reference(_adamw, 4).items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)
    c = replicas["c"]
    assert c is loaded[0] and c.shards.owned and len(c.shards.owned) < len(c.shards.params)
    # never more parts installed at once than it owns
    assert max(installed[id(c.optimizer)]) == len(c.shards.owned)


def _transposed_model() -> torch.nn.Module:
    """The sharding job's model with its first weight stored transposed (dense, not
    contiguous: as a channels-last convolution's), so that its gradient is too."""
    net = sharding.model()
    first = net[0]
    first.weight = torch.nn.Parameter(first.weight.detach().t().contiguous().t())
    assert not first.weight.is_contiguous()
    return net


@pytest.mark.timeout(120)
def test_stage_2_keeps_the_sums_of_parameters_laid_out_in_another_order_as_stage_0(tmp_path):
    job = TrainJob(model=_transposed_model, optimizer=_adamw, loss=sharding.mse,
                   dataset=sharding.data, lr_scheduler=sharding.warmup)
    schedule = [(["a", "b", "c"], 2), (["a", "c"], 1)]
    finals = {}
    for stage in (0, 2):
        replicas = _run(tmp_path / str(stage), job, _config(tmp_path / str(stage), stage=stage),
                        schedule)
        finals[stage] = replicas["a"].model.state_dict()
    for key, value in finals[0].items():
        torch.testing.assert_close(finals[2][key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_a_forming_generation_sends_no_parameters_over_the_control_plane(tmp_path, monkeypatch):
    """With sharded state every rank takes the parameters from their holders over the data
    plane as the generation forms; the committed state the source sends over the control
    plane holds the rest only (it held a second copy of the whole model). A fresh rank still
    ends on the plain process's weights."""
    from elastic.trainer import state as state_module

    sent: list[set[str]] = []  # the model keys of each state received
    inner = state_module.state_from_bytes

    def spy(data):
        state = inner(data)
        sent.append(set(state["model"]))
        return state

    monkeypatch.setattr("elastic.trainer.replica.state_from_bytes", spy)
    replicas = _run(tmp_path, _job(_sgd), _config(tmp_path, stage=1),
                    [(["a", "b"], 2), (["a", "c"], 2)])
    names = {name for name, _ in replicas["c"].model.named_parameters()}
    assert sent and all(not names & keys for keys in sent)
    for key, value in _reference(_sgd, 4).items():
        torch.testing.assert_close(replicas["c"].model.state_dict()[key], value, rtol=1e-5,
                                   atol=1e-5, msg=key)


def _with_frozen() -> torch.nn.Module:
    net = sharding.model()
    net.register_parameter("frozen", torch.nn.Parameter(torch.zeros(3), requires_grad=False))
    return net


def test_a_frozen_parameter_reaches_a_rank_that_joins_a_sharded_run(tmp_path):
    """A parameter that takes no gradient (a frozen backbone, an EMA teacher) is no sharded
    part: it comes with the rest of the committed state, not over the data plane."""
    job = TrainJob(model=_with_frozen, optimizer=_sgd, loss=sharding.mse, dataset=sharding.data)
    made: list[Replica] = []

    def make(job, config, run_dir):
        replica = Replica(job, config, run_dir)
        if not made:
            with torch.no_grad():
                replica.model.frozen.fill_(7.0)  # as a checkpoint or a teacher update left it
        made.append(replica)
        return replica

    replicas = _run(tmp_path, job, _config(tmp_path, stage=1, replicas=1),
                    [(["a"], 1), (["a", "b"], 1)], make=make)
    assert torch.equal(replicas["b"].model.frozen, torch.full((3,), 7.0))


def test_the_rank_that_loaded_a_checkpoint_hands_out_one_payload_at_a_time(tmp_path,
                                                                             monkeypatch):
    """It alone gives (every part's state, from the checkpoint): each receiver's message is
    made and sent before the next is made, so it holds the state and one payload, not the
    state twice. The weights are still those of one plain process."""
    from elastic.trainer import sharding as sharding_module

    first = _run(tmp_path / "a", _job(), _config(tmp_path / "a", stage=1, replicas=2),
                 [(["a", "b"], 2)])
    checkpoint = first["a"].state()
    calls: list[str] = []  # rank 0's ("c", the loader's): no other rank gives anything
    loader: list[Replica] = []
    serialise, exchange = sharding_module._serialise, sharding_module._exchange

    def spy_serialise(parts):
        calls.append("make")
        return serialise(parts)

    def spy_exchange(control, sends, recvs):
        if control.rank == 0 and sends:
            calls.append("send")
        return exchange(control, sends, recvs)

    monkeypatch.setattr(sharding_module, "_serialise", spy_serialise)
    monkeypatch.setattr(sharding_module, "_exchange", spy_exchange)

    def make(job, config, run_dir):
        replica = Replica(job, config, run_dir)
        if not loader:
            replica.load_state(checkpoint, origin="checkpoint")
            loader.append(replica)
        return replica

    replicas = _run(tmp_path / "c", _job(), _config(tmp_path / "c", stage=1, replicas=1),
                    [(["c", "d", "e"], 2)], make=make)
    assert replicas["c"] is loader[0]
    assert calls == ["make", "send", "send"] * 2
    final = replicas["e"].model.state_dict()
    for key, value in _reference(_adamw, 4).items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)


def _even_model() -> torch.nn.Module:
    """Parts of 48, 64, 64, 64, 64 and 8 elements: at replicas=2, growing from 2 ranks to 4
    has each of the 2 holders give parts to both newcomers."""
    layers = [torch.nn.Linear(6, 8, bias=False)] + [torch.nn.Linear(8, 8, bias=False)
                                                   for _ in range(4)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 1, bias=False))


def test_a_resize_moves_state_one_payload_at_a_time_on_every_rank(tmp_path, monkeypatch):
    """Two holders each give parts to the same two newcomers: every rank makes a receiver's
    payload only once the one before it was sent (it holds its state and one payload, not
    the state it gives twice; before, each made both first). The weights are stage 0's."""
    calls: dict[int, list[str]] = {}  # by thread: the ranks of a generation are threads
    serialise, exchange = sharding_module._serialise, sharding_module._exchange

    def spy_serialise(parts):
        calls.setdefault(threading.get_ident(), []).append("make")
        return serialise(parts)

    def spy_exchange(control, sends, recvs):
        if any(t.dtype == torch.uint8 for t, _ in sends):
            calls.setdefault(threading.get_ident(), []).append("send")
        return exchange(control, sends, recvs)

    job = TrainJob(model=_even_model, optimizer=_adamw, loss=sharding.mse,
                   dataset=sharding.data, lr_scheduler=sharding.warmup)
    schedule = [(["a", "b"], 2), (["a", "b", "c", "d"], 2)]
    monkeypatch.setattr(sharding_module, "_serialise", spy_serialise)
    monkeypatch.setattr(sharding_module, "_exchange", spy_exchange)
    sharded = _run(tmp_path / "s", job, _config(tmp_path / "s", stage=1), schedule)
    monkeypatch.undo()
    assert sorted(seq.count("make") for seq in calls.values()) == [2, 2], calls
    for seq in calls.values():
        assert seq == ["make", "send"] * 2, calls
    whole = _run(tmp_path / "w", job, _config(tmp_path / "w", stage=0), schedule)
    for x, y in zip(sharded["d"].model.parameters(), whole["d"].model.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_parts_that_arrived_before_a_later_exchange_failed_are_kept(monkeypatch):
    """Rank 0 of 3 takes part 0 from rank 2 (round 1: the rank before it), then part 1 from
    rank 1 (round 2), which fails: part 0 stays in `received` for the caller to keep and
    claim (before, every part came in one exchange: none arrived without all)."""
    from elastic.adapt.sharding import Move

    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    payload = sharding_module._serialise({0: {"exp_avg": torch.arange(4.0)}})
    rounds: list[int] = []

    class Control:
        rank, world_size = 0, 3

        def exchange(self, sends, recvs):
            (buf, src), = recvs
            rounds.append(src)
            if src == 1:
                raise CollectiveError("injected: rank 1 died")
            data = torch.frombuffer(payload, dtype=torch.uint8)
            buf.copy_(torch.tensor([len(data)]) if buf.dtype == torch.int64 else data)

        def wait(self, handle):
            pass

    received: dict = {}
    with pytest.raises(CollectiveError, match="injected"):
        sharding_module._move_state(Control(), [Move(0, 2, 0), Move(1, 1, 0)], {}, params,
                                    received=received)
    assert rounds == [2, 2, 1]
    assert list(received) == [0] and torch.equal(received[0]["exp_avg"], torch.arange(4.0))
