"""Mixed precision, the fp16 loss scale, clipping, parameter groups, schedulers, user metrics
and extra state, each against a plain-PyTorch loop written here, through a kill (a new
generation of 3 ranks restored from rank 0's committed state, as the controller does).
Ranks are threads of the test process (no Ray)."""

from __future__ import annotations

import datetime
import io
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import default_collate

from elastic import BatchConfig, FitConfig, LossSum, ScalingConfig, TrainJob
from elastic.adapt.lr import global_batch_for
from elastic.adapt.plan import plan_batch
from elastic.collective import RendezvousServer
from elastic.config import TrainingConfig
from elastic.errors import AfterStepError, ConfigError
from elastic.trainer.replica import StepRecord
from elastic.trainer.training import wants_model
from tests import fidelity
from tests.threads import run_ranks
from tests.unit.test_split_independence import _SerialReplica

B, G, SEED, N = 24, 6, 3, 96
KILL = [(4, 3, None), (3, 5, None)]  # 4 ranks for 3 steps, then 3 survivors for 5


def _run(tmp_path, job: TrainJob, training: TrainingConfig, schedule=KILL,
         batch: BatchConfig | None = None, num_workers: int = 4):
    """Runs `schedule` (world size, steps, weights per generation); returns rank 0's final
    state dict, rank 0's step records, and rank 0's last replica. Every rank must hold the
    same bits after every step. `batch` (default: B, fixed) with `num_workers` gives each
    generation's global batch."""
    batch = batch or BatchConfig(global_batch_size=B, autotune=False, rebalance=False)
    config = FitConfig(scaling=ScalingConfig(num_workers=num_workers, min_workers=1),
                       batch=batch, run_dir=str(tmp_path), max_steps=100, seed=SEED,
                       training=training)
    state, records, server = None, [], RendezvousServer()
    try:
        for world, steps, weights in schedule:
            size = global_batch_for(batch.policy, batch.global_batch_size, num_workers, world)
            plan = plan_batch(size, world, G, weights, unit=G)

            def body(comm, plan=plan, steps=steps, state=state):
                with _SerialReplica.compute_lock:
                    replica = _SerialReplica(job, config, str(tmp_path))
                replica.comm = comm
                if state is not None and comm.rank == 0:
                    replica.load_state_bytes(state)
                replica.sync_from(0)
                out = []
                for _ in range(steps):
                    record = replica.run_step(plan, [])
                    assert isinstance(record, StepRecord)
                    out.append((record, {k: v.clone() for k, v in replica.model.state_dict().items()}))
                return replica, out

            results = run_ranks(server, world, body)
            for step in zip(*(out for _, out in results), strict=True):
                for _, other in step[1:]:
                    assert all(torch.equal(other[k], step[0][1][k]) for k in other)
            records += [record for record, _ in results[0][1]]
            state = results[0][0].state_bytes()
    finally:
        server.close()
    final = results[0][0]
    return {k: v.clone() for k, v in final.model.state_dict().items()}, records, final


def _reference(job: TrainJob, steps: int, *, precision: str = "32", scaler=None, clip=None,
               scheduler_step=None, extra=None):
    """The plain loop: groups of G in the public order, autocast, a GradScaler, clipping and
    the scheduler as the README says. Returns the final state, and per step (loss, lr applied,
    pre-clip norm, skipped, scale before the step, metrics)."""
    torch.manual_seed(SEED)
    model = job.model()
    opt = job.optimizer(model if wants_model(job.optimizer) else model.parameters())
    sched = job.lr_scheduler(opt) if job.lr_scheduler else None
    ema = extra(model, opt)["ema"] if extra else None
    data = job.dataset()
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    log = []
    for step in range(steps):
        idx = fidelity._global_batch(len(data), SEED, B, step)
        opt.zero_grad()
        loss_sum, sums = 0.0, {}
        for first in range(0, B, G):
            fidelity.seed_all(fidelity.forward_seed(SEED, step, first))
            batch = default_collate([data[int(i)] for i in idx[first : first + G]])
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                out = job.loss(model, batch)
            loss, metrics = out if isinstance(out, tuple) else (out, {})
            for name, value in metrics.items():
                pair = sums.setdefault(name, [0.0, 0.0])
                if isinstance(value, LossSum):
                    pair[0] += _number(value.total)
                    pair[1] += _number(value.count)
                else:
                    pair[0] += _number(value) * G
                    pair[1] += G
            term = loss * G / B
            loss_sum += float(term.detach())
            (scaler.scale(term) if scaler else term).backward()
        scale = scaler.get_scale() if scaler else None
        if scaler:
            scaler.unscale_(opt)
        norm = None
        if clip is not None:
            kind, limit = clip
            params = list(model.parameters())
            if kind == "norm":
                norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
            else:
                norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
                torch.nn.utils.clip_grad_value_(params, limit)
        lr = opt.param_groups[0]["lr"]
        if scaler:
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < scale
        else:
            opt.step()
            skipped = False
        if ema is not None and not skipped:
            ema.after_step(model)
        if scheduler_step is not None:
            scheduler_step(sched, step, loss_sum, {k: s / w for k, (s, w) in sums.items() if w > 0})
        log.append({"loss": loss_sum, "lr": lr, "norm": norm, "skipped": skipped, "scale": scale,
                    "metrics": {k: s / w for k, (s, w) in sums.items() if w > 0}})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, log, ema


def _number(value) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def _close(final, expected, tol=1e-5):
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=tol, atol=tol, msg=key)


def _job(**kw) -> TrainJob:
    return TrainJob(**{"model": fidelity.mlp, "optimizer": fidelity.sgd, "loss": fidelity.mse,
                       "dataset": fidelity.regression, **kw})


# --- precision -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_bf16_autocast_matches_the_plain_autocast_loop_and_differs_from_float32(tmp_path):
    job = _job()
    final, _, _ = _run(tmp_path, job, TrainingConfig(precision="bf16-mixed"))
    expected, _, _ = _reference(job, 8, precision="bf16-mixed")
    _close(final, expected, tol=1e-4)
    plain, _, _ = _reference(job, 8)
    assert max(float((final[k] - plain[k]).abs().max()) for k in plain) > 1e-3  # autocast ran


class Overflowing(torch.utils.data.Dataset):
    """`fidelity.regression` with two samples whose inputs overflow float16 in the forward."""

    def __init__(self) -> None:
        self.x, self.y = fidelity.regression().tensors
        self.x = self.x.clone()
        self.x[[5, 50]] = 1e5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


@pytest.mark.timeout(120)
def test_fp16_skips_the_overflowing_steps_and_moves_the_scale_as_grad_scaler(tmp_path):
    job = _job(dataset=Overflowing)
    training = TrainingConfig(precision="fp16-mixed", init_scale=2.0**10, growth_interval=2)
    final, records, _ = _run(tmp_path, job, training)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    expected, log, _ = _reference(job, 8, precision="fp16-mixed", scaler=scaler)
    assert [bool(r.skipped_ranks) for r in records] == [e["skipped"] for e in log]
    assert any(e["skipped"] for e in log) and not all(e["skipped"] for e in log)
    assert [r.scale for r in records] == [e["scale"] for e in log]
    _close(final, expected, tol=1e-4)


def half_loss(model: nn.Module, batch):
    """An mse that stays float16 under fp16 autocast (the target is cast to the output's
    dtype), so that scaling it can overflow where a float32 loss would not."""
    x, y = batch
    out = model(x)
    return ((out - y.to(out.dtype)) ** 2).mean()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**10])
def test_fp16_with_a_float16_loss_skips_where_grad_scaler_skips(tmp_path, init_scale):
    # At 2**16 the scaled gradient of a float16 loss overflows: GradScaler skips those steps
    # too, and both settle at the same scale.
    job = _job(loss=half_loss)
    training = TrainingConfig(precision="fp16-mixed", init_scale=init_scale, growth_interval=2)
    final, records, _ = _run(tmp_path, job, training)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    expected, log, _ = _reference(job, 8, precision="fp16-mixed", scaler=scaler)
    assert [bool(r.skipped_ranks) for r in records] == [e["skipped"] for e in log]
    assert [r.scale for r in records] == [e["scale"] for e in log]
    assert any(e["skipped"] for e in log) == (init_scale == 2.0**16)
    _close(final, expected, tol=1e-3)


def bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


@pytest.mark.timeout(120)
def test_fp16_steps_grad_scaler_skips_still_update_the_batchnorm_statistics_as_its_loop(tmp_path):
    # A step skipped for an overflow in the scaled gradients ran its forward passes: a
    # GradScaler loop keeps their BatchNorm statistics (only optimizer.step is skipped).
    # Before, they were rolled back, so the running statistics parted from the loop's.
    job = _job(model=bn_mlp, loss=half_loss)
    training = TrainingConfig(precision="fp16-mixed", init_scale=2.0**16, growth_interval=2)
    final, records, _ = _run(tmp_path, job, training)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    expected, log, _ = _reference(job, 8, precision="fp16-mixed", scaler=scaler)
    assert [bool(r.skipped_ranks) for r in records] == [e["skipped"] for e in log]
    assert any(e["skipped"] for e in log)
    assert int(final["1.num_batches_tracked"]) == int(expected["1.num_batches_tracked"]) == 8 * B // G
    _close(final, expected, tol=1e-3)


# --- clipping, parameter groups ----------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["norm", "value"])
def test_clipping_after_the_allreduce_matches_and_logs_the_pre_clip_norm(tmp_path, kind):
    job = _job()
    limit = 0.5 if kind == "norm" else 0.05
    training = (TrainingConfig(clip_grad_norm=limit) if kind == "norm"
                else TrainingConfig(clip_grad_value=limit))
    final, records, _ = _run(tmp_path, job, training)
    expected, log, _ = _reference(job, 8, clip=(kind, limit))
    _close(final, expected)
    norms = [r.grad_norm for r in records]
    assert max(norms) > limit  # clipping did something
    torch.testing.assert_close(norms, [e["norm"] for e in log], rtol=1e-5, atol=1e-6)
    unclipped, _, _ = _reference(job, 8)
    assert max(float((final[k] - unclipped[k]).abs().max()) for k in unclipped) > 1e-3


def grouped_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """Weight decay on the weights only, built from the names (the factory takes the model)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5},
                              {"params": rest, "weight_decay": 0.0}], lr=0.01)


@pytest.mark.timeout(120)
def test_parameter_groups_by_name_from_a_factory_that_takes_the_model(tmp_path):
    job = _job(optimizer=grouped_adamw)
    final, _, replica = _run(tmp_path, job, TrainingConfig())
    assert [g["weight_decay"] for g in replica.optimizer.param_groups] == [0.5, 0.0]
    expected, _, _ = _reference(job, 8)
    _close(final, expected)


def test_the_old_optimizer_form_still_gets_the_parameters():
    assert wants_model(grouped_adamw)
    assert not wants_model(fidelity.sgd)
    assert not wants_model(lambda params: None)

    def annotated(m: nn.Module):
        return m

    assert wants_model(annotated)
    assert not wants_model(torch.optim.SGD)  # a class: its first parameter is params


# --- schedulers --------------------------------------------------------------------------------


def plateau(opt):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.2)


@pytest.mark.timeout(120)
def test_a_plateau_scheduler_steps_on_the_global_loss_of_each_step(tmp_path):
    job = _job(lr_scheduler=plateau)
    final, records, _ = _run(tmp_path, job, TrainingConfig(scheduler_monitor="loss"))
    expected, log, _ = _reference(job, 8, scheduler_step=lambda s, step, loss, m: s.step(loss))
    assert [r.lr for r in records] == pytest.approx([e["lr"] for e in log], rel=1e-12)
    assert len({e["lr"] for e in log}) > 1  # it reduced
    _close(final, expected)


def sometimes_loss(model: nn.Module, batch):
    """The mse, with a metric over the samples whose target is above 2: none in some global
    batches (steps 0, 2 and 4 here), where its count sums to 0."""
    x, y = batch
    err = model(x) - y
    big = y > 2.0
    return F.mse_loss(model(x), y), {"big": LossSum(err[big].abs().sum(), int(big.sum()))}


@pytest.mark.timeout(120)
def test_a_plateau_scheduler_on_a_metric_some_steps_lack_skips_those_steps(tmp_path):
    # Before: the first step without a value failed the run ("is neither 'loss' nor a metric
    # TrainJob.loss returns"), after it was applied.
    job = _job(loss=sometimes_loss, lr_scheduler=plateau)
    final, records, replica = _run(tmp_path, job, TrainingConfig(scheduler_monitor="big"))
    expected, log, _ = _reference(
        job, 8, scheduler_step=lambda s, step, loss, m: s.step(m["big"]) if "big" in m else None)
    assert ["big" in e["metrics"] for e in log] == [False, True, False, True, False, True,
                                                   True, True]
    assert [r.lr for r in records] == pytest.approx([e["lr"] for e in log], rel=1e-12)
    assert replica.metric_names == ("big",)
    _close(final, expected)


def halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


@pytest.mark.timeout(120)
def test_an_epoch_scheduler_steps_once_per_epoch_across_a_kill(tmp_path):
    job = _job(lr_scheduler=halving)
    per_epoch = N // B  # 4: the kill after step 3 falls inside the first epoch
    final, records, _ = _run(tmp_path, job, TrainingConfig(scheduler_interval="epoch"))
    expected, log, _ = _reference(
        job, 8, scheduler_step=lambda s, step, loss, m: s.step() if (step + 1) % per_epoch == 0 else None)
    assert [r.lr for r in records] == [0.1] * 4 + [0.05] * 4 == [e["lr"] for e in log]
    _close(final, expected)


@pytest.mark.timeout(120)
def test_an_epoch_scheduler_steps_once_per_epoch_when_the_batch_follows_the_world_size(tmp_path):
    """Policy 'scale_with_workers' (96 samples): 3 ranks (batch 36) see epoch 0 end after
    step 1, but 2 ranks (batch 24) still fit step 2 in it: the scheduler stepped once for it,
    not twice. Steps 3 to 5 leave 24 samples of epoch 1, which the next step at 3 ranks
    cannot fill: epoch 1 ends unseen, and the scheduler steps for it before step 6's update
    (before, it never did)."""
    batch = BatchConfig(global_batch_size=24, policy="scale_with_workers", lr_scaling="none",
                        autotune=False, rebalance=False)
    _, records, _ = _run(tmp_path, _job(lr_scheduler=halving),
                         TrainingConfig(scheduler_interval="epoch"),
                         [(3, 2, None), (2, 4, None), (3, 1, None)], batch=batch, num_workers=2)
    assert [(r.epoch, r.lr) for r in records] == [
        (0, 0.1), (0, 0.1), (0, 0.05), (1, 0.05), (1, 0.05), (1, 0.05), (2, 0.025)]


def test_a_plateau_scheduler_without_a_monitor_is_refused(tmp_path):
    config = FitConfig(scaling=ScalingConfig(num_workers=1), batch=BatchConfig(global_batch_size=B),
                       run_dir=str(tmp_path), max_steps=2)
    with pytest.raises(ConfigError, match="scheduler_monitor"):
        _SerialReplica(_job(lr_scheduler=plateau), config, str(tmp_path))


def failing_scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 2 else 1 / 0)


@pytest.mark.timeout(120)
def test_a_scheduler_error_fails_the_step_after_it_was_applied_without_a_retry(tmp_path):
    with pytest.raises(AfterStepError) as info:
        _run(tmp_path, _job(lr_scheduler=failing_scheduler), TrainingConfig(), [(2, 4, None)])
    assert info.value.step == 1 and "ZeroDivisionError" in info.value.traceback


# --- user metrics ------------------------------------------------------------------------------


def metric_loss(model: nn.Module, batch):
    """The mse with a mean metric, a LossSum metric, and one only some micro-batches have."""
    x, y = batch
    err = model(x) - y
    metrics = {"mae": err.abs().mean(), "hits": LossSum((err.abs() < 1.0).sum(), len(y))}
    if bool((y > 1.5).any()):
        metrics["large"] = LossSum(err[y > 1.5].abs().sum(), int((y > 1.5).sum()))
    return F.mse_loss(model(x), y), metrics


@pytest.mark.timeout(120)
def test_user_metrics_are_the_global_batch_values_whatever_the_split(tmp_path):
    job = _job(loss=metric_loss)
    final, records, replica = _run(tmp_path, job, TrainingConfig())
    expected, log, _ = _reference(job, 8)
    _close(final, expected)
    assert replica.metric_names == ("hits", "large", "mae")
    for record, e in zip(records, log, strict=True):
        assert record.metrics.keys() == e["metrics"].keys()
        for name, value in e["metrics"].items():
            assert math.isclose(record.metrics[name], value, rel_tol=1e-5, abs_tol=1e-7), name


# --- extra state -------------------------------------------------------------------------------


class Ema:
    """An exponential moving average of the weights, updated after each applied step."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.updates = 0

    def after_step(self, model: nn.Module) -> None:
        self.updates += 1
        for k, v in model.state_dict().items():
            self.shadow[k].mul_(0.9).add_(v.detach(), alpha=0.1)

    def state_dict(self):
        return {"shadow": self.shadow, "updates": self.updates}

    def load_state_dict(self, state) -> None:
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
        self.updates = state["updates"]


def ema_state(model, optimizer):
    return {"ema": Ema(model)}


@pytest.mark.timeout(120)
def test_extra_state_travels_with_peer_restore_and_matches_the_plain_loop(tmp_path):
    job = _job(extra_state=ema_state)
    final, _, replica = _run(tmp_path, job, TrainingConfig())
    expected, _, ema = _reference(job, 8, extra=ema_state)
    _close(final, expected)
    assert replica.extra["ema"].updates == 8 == ema.updates
    _close(replica.extra["ema"].shadow, ema.shadow)
    saved = torch.load(io.BytesIO(replica.state_bytes()), weights_only=True)
    assert saved["extra"]["ema"]["updates"] == 8


class HoldsAnObject:
    """Extra state whose state_dict holds something weights-only loading refuses."""

    def state_dict(self):
        return {"when": datetime.timedelta(seconds=1)}

    def load_state_dict(self, state) -> None:
        pass


def test_extra_state_that_weights_only_loading_refuses_is_refused_up_front(tmp_path):
    config = FitConfig(scaling=ScalingConfig(num_workers=1), batch=BatchConfig(global_batch_size=B),
                       run_dir=str(tmp_path), max_steps=2)
    with pytest.raises(ConfigError, match=r"extra_state\['odd'\].*weights_only=True"):
        _SerialReplica(_job(extra_state=lambda m, o: {"odd": HoldsAnObject()}), config, str(tmp_path))


def test_extra_state_without_state_dict_is_refused(tmp_path):
    config = FitConfig(scaling=ScalingConfig(num_workers=1), batch=BatchConfig(global_batch_size=B),
                       run_dir=str(tmp_path), max_steps=2)
    with pytest.raises(ConfigError, match="state_dict"):
        _SerialReplica(_job(extra_state=lambda m, o: {"x": object()}), config, str(tmp_path))


def test_precision_with_exact_mode_and_two_clippings_are_refused():
    base = {"scaling": {"num_workers": 2}, "batch": {"global_batch_size": 8}, "max_steps": 2}
    with pytest.raises(ValueError, match="clip_grad_norm and training"):
        FitConfig(**base, training={"clip_grad_norm": 1.0, "clip_grad_value": 1.0})
    with pytest.raises(ValueError, match="precision"):
        FitConfig(**{**base, "batch": {"global_batch_size": 8, "exact": True}},
                  training={"precision": "bf16-mixed"})


def test_the_peer_state_bound_counts_the_extra_state():
    from elastic.trainer.replica import max_state_bytes

    big = nn.Linear(512, 512)
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    extra = {"ema": Ema(big), "ema2": Ema(big)}
    model_bytes = sum(v.numel() * 4 for v in big.state_dict().values())
    assert max_state_bytes(big, opt, extra) - max_state_bytes(big, opt) == 2 * 2 * model_bytes


class LazyEma(Ema):
    """An EMA whose shadow weights exist only from its first update on."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow, self.updates = {}, 0

    def after_step(self, model: nn.Module) -> None:
        if not self.shadow:
            self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        super().after_step(model)


def test_the_peer_state_bound_of_a_fresh_replica_admits_a_trained_peers_lazy_extra_state():
    # amsgrad holds three tensors per parameter: with the EMA the sender's state is five times
    # the model's, more than a fresh replica's own (empty) EMA would allow for.
    from elastic.trainer.replica import max_state_bytes

    def replica():
        torch.manual_seed(0)
        model = nn.Linear(4096, 2048)
        return model, torch.optim.Adam(model.parameters(), amsgrad=True), {"ema": LazyEma(model)}

    peer, peer_opt, peer_extra = replica()
    peer(torch.randn(2, 4096)).sum().backward()
    peer_opt.step()
    peer_extra["ema"].after_step(peer)
    buffer = io.BytesIO()
    torch.save({"model": peer.state_dict(), "optimizer": peer_opt.state_dict(),
                "extra": {"ema": peer_extra["ema"].state_dict()}}, buffer)
    assert len(buffer.getvalue()) <= max_state_bytes(*replica())


def test_a_state_written_without_fp16_keeps_the_init_scale():
    from elastic.trainer.training import Training

    fp16 = Training(TrainingConfig(precision="fp16-mixed"), None)
    fp16.load_state_dict(Training(TrainingConfig(), None).state_dict())  # a bf16/fp32 checkpoint
    assert fp16.scale == 2.0**16
    saved = {**fp16.state_dict(), "scale": 8.0}
    fp16.load_state_dict(saved)
    assert fp16.scale == 8.0


def test_the_evaluation_refuses_empty_metric_names():
    from elastic.trainer.evaluation import metric_terms

    with pytest.raises(TypeError, match="non-empty"):
        metric_terms({"": (1.0, 2)})


@pytest.mark.timeout(120)
def test_a_monitor_the_loss_does_not_return_fails_as_an_after_step_error(tmp_path):
    with pytest.raises(AfterStepError) as info:
        _run(tmp_path, _job(lr_scheduler=plateau), TrainingConfig(scheduler_monitor="accuracy"),
             [(2, 2, None)])
    assert info.value.step == 0 and "'accuracy' is neither 'loss' nor a metric" in str(info.value)


def test_an_evaluation_scheduler_steps_once_per_evaluated_step_and_the_state_remembers_it():
    from elastic.trainer.training import Training

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0)
    config = TrainingConfig(scheduler_interval="evaluation", scheduler_monitor="eval/mse")
    training = Training(config, plateau)
    training.after_step(3, 0, True, 0.5, {}, epoch=0, epoch_over=True)  # steps leave it alone
    training.after_evaluation(4, 0, {"mse": 2.0})
    training.after_evaluation(8, 0, {"mse": 1.0})  # not better in 'max' mode: halves
    assert opt.param_groups[0]["lr"] == 0.5
    saved = training.state_dict()
    training.after_evaluation(8, 0, {"mse": 1.0})  # the same evaluation run again: no step
    assert opt.param_groups[0]["lr"] == 0.5
    again = Training(config, plateau)
    again.load_state_dict(saved)
    again.after_evaluation(8, 0, {"mse": 1.0})  # a replica restored from that state: no step
    assert opt.param_groups[0]["lr"] == 0.5 and again.evaluated_step == 8
    with pytest.raises(AfterStepError, match=r"'eval/mse' is not a metric .* returns") as info:
        again.after_evaluation(12, 1, {"acc": 1.0})
    assert (info.value.rank, info.value.step) == (1, 12)


def test_an_evaluation_scheduler_is_configured_consistently(tmp_path):
    with pytest.raises(ValueError, match="scheduler_interval='evaluation'"):
        TrainingConfig(scheduler_monitor="eval/mse")
    with pytest.raises(ValueError, match="name it 'eval/<name>'"):
        TrainingConfig(scheduler_interval="evaluation", scheduler_monitor="loss")
    with pytest.raises(ValueError, match="names no metric"):
        TrainingConfig(scheduler_interval="evaluation", scheduler_monitor="eval/")
    config = FitConfig(scaling=ScalingConfig(num_workers=1), batch=BatchConfig(global_batch_size=B),
                       run_dir=str(tmp_path), max_steps=2,
                       training=TrainingConfig(scheduler_interval="evaluation"))
    with pytest.raises(ConfigError, match=r"no TrainJob\.eval_step"):
        _SerialReplica(_job(lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1)), config,
                       str(tmp_path))
