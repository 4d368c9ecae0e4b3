"""Split-independent loss normalisation (`elastic.LossSum`), checked without Ray: a padded-token
language model trained with a sum-and-count loss ends with the same weights as a plain-PyTorch
loop over the global batches, whatever the shares, micro-batches and world size; the same model
with a token-mean loss does not (why `LossSum` exists); ranks that disagree on the form, or a
global count of 0, are a user error of the step."""

import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.data import TensorDataset

from elastic import BatchConfig, FitConfig, LossSum, ScalingConfig, TrainJob
from elastic.adapt.plan import BatchPlan
from elastic.collective import RendezvousServer
from elastic.config import CollectiveConfig
from elastic.trainer.loss import LossForm, form_error
from elastic.trainer.replica import Replica, StepRecord, UserFailure
from elastic.trainer.step import Commit, Vote, verdict
from tests.threads import run_ranks

PAD, VOCAB, LENGTH, N, B, STEPS, SEED = 0, 11, 9, 32, 8, 6, 0


def make_dataset() -> TensorDataset:
    """Token sequences padded to LENGTH, each with its own number of real tokens (1 to 8
    targets), so a token mean depends on which samples share a micro-batch."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, VOCAB, (N, LENGTH), generator=g)
    real = torch.randint(2, LENGTH + 1, (N,), generator=g)
    tokens[torch.arange(LENGTH) >= real[:, None]] = PAD
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def make_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)).double()


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def token_sum(model: nn.Module, batch) -> LossSum:
    x, y = batch
    total = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=PAD,
                            reduction="sum")
    return LossSum(total, (y != PAD).sum())


def token_mean(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=PAD)


def job(loss) -> TrainJob:
    return TrainJob(model=make_model, optimizer=make_optimizer, loss=loss, dataset=make_dataset)


def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, one optimizer step per global batch of the public sample order, the loss
    the sum of token losses over the global batch divided by its token count. No project code."""
    torch.manual_seed(SEED)
    model = make_model()
    opt = make_optimizer(model.parameters())
    x, y = make_dataset().tensors
    losses = []
    for step in range(STEPS):
        epoch, s = divmod(step, N // B)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))
        idx = perm[s * B : (s + 1) * B]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]).reshape(-1, VOCAB), y[idx].reshape(-1),
                               ignore_index=PAD, reduction="sum") / (y[idx] != PAD).sum()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def run(tmp_path, jobs: list[TrainJob], plan: BatchPlan, overlap: bool = False, steps: int = STEPS):
    """`steps` steps of `plan` on ranks as threads (rank r runs `jobs[r]`); each rank's
    outcomes and replica."""
    config = FitConfig(
        scaling=ScalingConfig(num_workers=plan.world_size, min_workers=1),
        collective=CollectiveConfig(overlap=overlap, bucket_bytes=1024, first_bucket_bytes=1024),
        batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=steps, seed=SEED)
    building = threading.Lock()  # the model is built under the process-wide torch seed

    def body(comm):
        with building:
            replica = Replica(jobs[comm.rank], config, str(tmp_path))
        replica.comm = comm
        replica.sync_from(0)
        return [replica.run_step(plan, []) for _ in range(steps)], replica

    server = RendezvousServer()
    try:
        return run_ranks(server, plan.world_size, body)
    finally:
        server.close()


PLANS = {
    "shares-5-3": BatchPlan(B, (5, 3), (2, 3)),
    "shares-2-6": BatchPlan(B, (2, 6), (2, 4)),
    "one-rank": BatchPlan(B, (B,), (3,)),
    "three-ranks-one-idle": BatchPlan(B, (3, 0, 5), (1, 1, 2)),
}


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_a_token_sum_and_count_trains_the_same_weights_for_any_split(tmp_path, plan, overlap):
    weights, losses = reference()
    results = run(tmp_path, [job(token_sum)] * plan.world_size, plan, overlap)
    for outcomes, replica in results:
        assert all(isinstance(o, StepRecord) for o in outcomes)
        assert [o.loss for o in outcomes] == pytest.approx(losses, rel=1e-9)
        torch.testing.assert_close(replica.model.state_dict(), weights, rtol=0, atol=1e-6)


def test_a_token_mean_as_a_scalar_loss_depends_on_the_split(tmp_path):
    weights, _ = reference()
    runs = [run(tmp_path / name, [job(token_mean)] * PLANS[name].world_size, PLANS[name])
            for name in ("shares-5-3", "shares-2-6")]
    finals = [results[0][1].model.state_dict() for results in runs]
    for final in finals:
        assert max(float((final[k] - weights[k]).abs().max()) for k in weights) > 1e-3
    assert max(float((finals[0][k] - finals[1][k]).abs().max()) for k in weights) > 1e-3


def test_ranks_that_return_different_forms_vote_the_step_down_as_a_user_error(tmp_path):
    results = run(tmp_path, [job(token_sum), job(token_mean)], PLANS["shares-5-3"], steps=1)
    for outcomes, replica in results:
        (failure,) = outcomes
        assert isinstance(failure, UserFailure)
        assert failure.ranks == (0, 1)
        assert "LossSum on ranks [0] and a scalar on ranks [1]" in failure.traceback
        assert replica.global_step == 0
        assert all(p.grad is None for p in replica.model.parameters())


def test_a_rank_that_changes_form_between_micro_batches_raises_a_user_error(tmp_path):
    calls = []

    def alternating(model, batch):
        calls.append(None)
        return token_sum(model, batch) if len(calls) % 2 else token_mean(model, batch)

    (outcomes, replica), = run(tmp_path, [job(alternating)], PLANS["one-rank"], steps=1)
    assert isinstance(outcomes[0], UserFailure)
    assert "ValueError: TrainJob.loss returned a scalar after a LossSum" in outcomes[0].traceback
    assert replica.global_step == 0


@pytest.mark.parametrize("shape", ["per_sample", "per_sample_sum", "float"])
def test_a_loss_that_is_not_one_element_is_a_user_error_that_says_so(tmp_path, shape):
    def unreduced(model, batch):
        x, y = batch
        per = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
        if shape == "per_sample":
            return per
        if shape == "per_sample_sum":
            return LossSum(per, (y != PAD).sum())
        return float(per.detach().mean())

    (outcomes, replica), = run(tmp_path, [job(unreduced)], PLANS["one-rank"], steps=1)
    assert isinstance(outcomes[0], UserFailure)
    tokens = (PLANS["one-rank"].micro_batches[0]) * (LENGTH - 1)  # one loss per target token
    expected = {"per_sample": f"returned a tensor of shape ({tokens},); it must be a tensor of one",
                "per_sample_sum": f"returned a tensor of shape ({tokens},) as LossSum.total",
                "float": "returned a float; it must be a tensor of one element"}[shape]
    assert f"ValueError: TrainJob.loss {expected}" in outcomes[0].traceback
    assert replica.global_step == 0


def padded_dataset() -> TensorDataset:
    """`make_dataset`'s sequences, every fourth of them padding alone (no target token)."""
    x, y = make_dataset().tensors
    y = y.clone()
    y[::4] = PAD
    return TensorDataset(x, y)


def guarded_sum(model: nn.Module, batch) -> LossSum:
    """A token sum that, for a micro-batch with no target token, returns a constant: what a
    plain loop's guard against dividing by zero tokens often does."""
    _, y = batch
    count = (y != PAD).sum()
    if int(count) == 0:
        return LossSum(torch.zeros((), dtype=torch.float64), 0)
    return token_sum(model, batch)


@pytest.mark.parametrize("overlap", [False, True], ids=["flat", "buckets"])
@pytest.mark.parametrize("plan", [BatchPlan(B, (5, 3), (1, 1)), BatchPlan(B, (B,), (1,))],
                         ids=["two-ranks", "one-rank"])
def test_a_micro_batch_of_padding_alone_may_return_a_constant_loss_sum_of_count_0(
        tmp_path, plan, overlap):
    # Before, its backward raised ("does not require grad"): a user error after retries,
    # where the plain loop over the global batch (which always has tokens) trains.
    torch.manual_seed(SEED)
    model = make_model()
    opt = make_optimizer(model.parameters())
    x, y = padded_dataset().tensors
    for step in range(STEPS):
        epoch, s = divmod(step, N // B)
        idx = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))[
            s * B : (s + 1) * B]
        opt.zero_grad()
        assert int((y[idx] != PAD).sum()) > 0
        (token_sum(model, (x[idx], y[idx])).total / (y[idx] != PAD).sum()).backward()
        opt.step()
    padded = TrainJob(model=make_model, optimizer=make_optimizer, loss=guarded_sum,
                      dataset=padded_dataset)
    for outcomes, replica in run(tmp_path, [padded] * plan.world_size, plan, overlap):
        assert all(isinstance(o, StepRecord) for o in outcomes), outcomes
        torch.testing.assert_close(replica.model.state_dict(), model.state_dict(), rtol=0,
                                   atol=1e-6)


def test_a_constant_loss_that_weighs_something_is_still_a_user_error(tmp_path):
    def detached(model, batch):  # a loss cut from the graph: a bug, said as in a plain loop
        return LossSum(token_sum(model, batch).total.detach(), 3)

    (outcomes, replica), = run(tmp_path, [job(detached)], PLANS["one-rank"], steps=1)
    assert isinstance(outcomes[0], UserFailure)
    assert "does not require grad" in outcomes[0].traceback
    assert replica.global_step == 0


def test_a_global_count_of_zero_is_a_user_error(tmp_path):
    def nothing_counts(model, batch):
        return LossSum(token_sum(model, batch).total * 0, 0)

    results = run(tmp_path, [job(nothing_counts)] * 2, PLANS["shares-2-6"], steps=1)
    for outcomes, replica in results:
        assert isinstance(outcomes[0], UserFailure)
        assert "counts that sum to 0" in outcomes[0].traceback
        assert replica.global_step == 0


def test_forms_may_change_between_steps(tmp_path):
    calls = []

    def by_step(model, batch):  # one micro-batch per rank and step: two calls a step
        calls.append(None)
        return token_sum(model, batch) if len(calls) <= 2 else token_mean(model, batch)

    results = run(tmp_path, [job(by_step)] * 2, BatchPlan(B, (4, 4), (4, 4)), steps=2)
    assert all(isinstance(o, StepRecord) for outcomes, _ in results for o in outcomes)


def test_the_verdict_divides_by_the_count_only_for_sums_and_names_disagreeing_ranks():
    ok, none, mean, total = float(Vote.OK), float(LossForm.NONE), float(LossForm.MEAN), \
        float(LossForm.SUM)
    assert verdict(3, (ok, ok), "stop", None, (mean, mean), 0.0) == Commit()
    assert verdict(3, (ok, ok, ok), "stop", None, (total, none, total), 12.0) == Commit(divisor=12.0)
    failure = verdict(3, (ok, ok, ok), "stop", None, (total, none, mean), 12.0)
    assert isinstance(failure, UserFailure) and failure.ranks == (0, 2)
    # An out-of-memory rank's count is missing: no zero-count error, the step is redone.
    assert form_error(3, (total, total), 0.0, complete=False) is None


class _ScalarReads(TorchFunctionMode):
    """Counts the host's reads of one-element tensors (on a GPU each waits for the device to
    finish what was queued before it) made under it."""

    READS = frozenset({"tolist", "item", "__float__", "__bool__", "__int__", "__index__"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS and args[0].numel() == 1:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _one_rank(tmp_path, loss) -> tuple[Replica, object]:
    from elastic.collective import Communicator

    config = FitConfig(scaling=ScalingConfig(num_workers=1),
                       batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                       run_dir=str(tmp_path), max_steps=STEPS, seed=SEED, ledger=True)
    replica = Replica(job(loss), config, str(tmp_path))
    server = RendezvousServer()
    replica.comm = Communicator(0, 1, server.endpoint, 0, config.collective, secret=server.secret)
    return replica, server


def token_sum_and_metrics(model: nn.Module, batch):
    """`token_sum` with two metrics beside it: a tensor mean and a `LossSum` of tensors."""
    out = token_sum(model, batch)
    _, y = batch
    return out, {"real_share": (y != PAD).double().mean(),
                 "tokens": LossSum(out.count, torch.tensor(len(y)))}


@pytest.mark.parametrize("gpu_way", [True, False], ids=["gpu_way", "cpu_way"])
def test_the_losses_counts_and_metrics_of_every_micro_batch_are_read_once_per_step_on_a_gpu(
        tmp_path, monkeypatch, gpu_way):
    """On a GPU (`device.batched_read`, run here on the CPU) the micro-batches' losses,
    `LossSum` counts and metrics are read by the host together after the last backward pass:
    a step of 4 micro-batches reads as many scalars as a step of 1 (each micro-batch's reads
    would stall the device between micro-batches); losses, metrics and weights stay the plain
    loop's. On the CPU each is read as it comes (nothing to wait for)."""
    from elastic.trainer import device

    monkeypatch.setattr(device, "batched_read", lambda where: gpu_way)
    weights, losses = reference()
    replica, server = _one_rank(tmp_path, token_sum_and_metrics)
    _, y = make_dataset().tensors
    try:
        reads, outcomes = [], []
        for step in range(STEPS):  # 1 micro-batch of 8, then 4 of 2, in turn
            plan = BatchPlan(B, (B,), (B,) if step % 2 == 0 else (2,))
            with _ScalarReads() as counted:
                outcomes.append(replica.run_step(plan, []))
            reads.append(counted.count)
    finally:
        replica.close()
        replica.comm.close()
        server.close()
    assert [o.loss for o in outcomes] == pytest.approx(losses, rel=1e-9)
    torch.testing.assert_close(replica.model.state_dict(), weights, rtol=0, atol=1e-6)
    for o in outcomes:  # the global batch's: tokens per sequence, share of real targets
        real = (y[list(o.indices)] != PAD)
        assert o.metrics == pytest.approx({"tokens": float(real.sum()) / B,
                                           "real_share": float(real.double().mean())}, rel=1e-12)
    # Steps 0 and 1 left out: the first step that names metrics exchanges the names.
    one, four = set(reads[2::2]), set(reads[3::2])
    assert len(one) == len(four) == 1, reads
    # The CPU's way reads the 5 values of each of the 3 more micro-batches (loss, count, the
    # mean metric, the LossSum metric's total and count): what the GPU's way saves.
    assert four.pop() - one.pop() == (0 if gpu_way else 15)


def test_a_loss_sum_count_of_several_elements_is_a_user_error_that_says_so(tmp_path):
    def per_sample_counts(model, batch):
        total = token_sum(model, batch).total
        return LossSum(total, (batch[1] != PAD).sum(dim=1))

    (outcomes, replica), = run(tmp_path, [job(per_sample_counts)], PLANS["one-rank"], steps=1)
    assert isinstance(outcomes[0], UserFailure)
    assert ("ValueError: LossSum.count must be a number or a real tensor of one element, got a "
            "tensor of shape (3,)") in outcomes[0].traceback
    assert replica.global_step == 0


@pytest.mark.parametrize("gpu_way", [True, False], ids=["gpu_way", "cpu_way"])
def test_a_metric_tensor_changed_in_place_later_in_the_step_counts_as_it_was_returned(
        tmp_path, monkeypatch, gpu_way):
    """A value kept for the step's one read is the value as the loss returned it: a tensor of
    the user's changed in place by a later micro-batch does not change what was summed."""
    from elastic.trainer import device

    monkeypatch.setattr(device, "batched_read", lambda where: gpu_way)
    calls = torch.zeros((), dtype=torch.float64)

    def counting(model, batch):
        calls.add_(1)  # one tensor, returned by every micro-batch, then changed in place
        return token_sum(model, batch), {"call": calls}

    replica, server = _one_rank(tmp_path, counting)
    try:
        record = replica.run_step(BatchPlan(B, (B,), (2,)), [])  # 4 micro-batches of 2
    finally:
        replica.close()
        replica.comm.close()
        server.close()
    assert record.metrics["call"] == pytest.approx((1 + 2 + 3 + 4) / 4)


def test_a_failed_read_of_the_steps_values_is_the_steps_user_error_not_a_crash(
        tmp_path, monkeypatch):
    """On a GPU the step's values are read after its last backward pass, where an error on
    the device surfaces: it is this rank's user error in the vote, and the failed attempt's
    metrics are never read again (the reduce would raise it a second time, outside the vote).
    A metric on the meta device (its reads raise) stands for such a device here."""
    from elastic.trainer import device

    monkeypatch.setattr(device, "batched_read", lambda where: True)

    def unreadable(model, batch):
        return token_sum(model, batch), {"broken": torch.ones((), device="meta")}

    replica, server = _one_rank(tmp_path, unreadable)
    try:
        outcome = replica.run_step(BatchPlan(B, (B,), (2,)), [])
    finally:
        replica.close()
        replica.comm.close()
        server.close()
    assert isinstance(outcome, UserFailure) and replica.global_step == 0
    assert "meta" in outcome.traceback


def test_a_metric_of_several_elements_is_a_user_error_that_says_so(tmp_path):
    def per_sample_metric(model, batch):
        return token_sum(model, batch), {"real": (batch[1] != PAD).sum(dim=1)}

    (outcomes, replica), = run(tmp_path, [job(per_sample_metric)], PLANS["one-rank"], steps=1)
    assert isinstance(outcomes[0], UserFailure)
    assert ("ValueError: a metric must be a number or a real tensor of one element, got a "
            "tensor of shape (3,)") in outcomes[0].traceback
    assert replica.global_step == 0
