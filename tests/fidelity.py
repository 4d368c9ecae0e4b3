"""The models people train, small: a CNN with BatchNorm, a padded-token language model with a
sum-and-count loss, an MLP with dropout, a model with parameters some steps do not reach
(float32, as users train them), and a plain-PyTorch reference loop that does not use the
project's training code.

The reference is what the README promises an elastic run equals: one process, the public
sample order (`perm_e = randperm(N, seed + e)`, step s of epoch e takes `perm_e[s*B:(s+1)*B]`),
the global batch cut into groups of G consecutive samples, one forward per group with the
random-number generators (torch's, Python's, NumPy's) seeded by
`elastic.forward_seed(seed, step, j * G)` before group j's samples are loaded; a scalar
loss scaled by G/B, a `LossSum` total backpropagated as is and the gradients divided by the
summed count before the optimizer step.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset, default_collate

from elastic import LossSum, TrainJob, forward_seed

N = 96
PAD = 0
VOCAB = 11
SEQ = 8


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# --- a CNN with BatchNorm (one layer with momentum None: a cumulative average) ---------------


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(N, 3, 6, 6, generator=g), torch.randint(0, 4, (N,), generator=g))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))


def classify(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def cnn_job() -> TrainJob:
    return TrainJob(model=cnn, optimizer=sgd, loss=classify, dataset=images)


# --- a padded-token language model with a sum-and-count loss ----------------------------------


def tokens() -> TensorDataset:
    """Sequences of 1 to SEQ tokens, padded with PAD; y is x shifted (PAD where padded)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randint(1, VOCAB, (N, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (N,), generator=g)
    pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
    y = torch.roll(x, -1, dims=1)
    x[pad] = PAD
    y[pad | (torch.arange(SEQ)[None, :] == SEQ - 1)] = PAD
    return TensorDataset(x, y)


def lm() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, VOCAB))


def token_loss(model: nn.Module, batch) -> LossSum:
    x, y = batch
    logits = model(x)
    total = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=PAD,
                            reduction="sum")
    return LossSum(total, (y != PAD).sum())


def lm_job() -> TrainJob:
    return TrainJob(model=lm, optimizer=sgd, loss=token_loss, dataset=tokens)


# --- an MLP with dropout -----------------------------------------------------------------------


def regression() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, x @ torch.randn(6, 1, generator=g))


def dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def dropout_job() -> TrainJob:
    return TrainJob(model=dropout_mlp, optimizer=sgd, loss=mse, dataset=regression)


class RandomLayers(nn.Module):
    """Randomness in layers other than `nn.Dropout` (`batch.groups` 'auto' must find it):
    attention dropout, dropout between the layers of an LSTM, RReLU's random slopes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(1, 8)
        self.attention = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)
        self.lstm = nn.LSTM(8, 8, num_layers=2, dropout=0.3, batch_first=True)
        self.act = nn.RReLU()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, 6): a sequence of 6 values
        h = self.embed(x.unsqueeze(-1))
        h, _ = self.attention(h, h, h, need_weights=False)
        h, _ = self.lstm(h)
        return self.head(self.act(h[:, -1]))


def random_layers_job() -> TrainJob:
    return TrainJob(model=RandomLayers, optimizer=sgd, loss=mse, dataset=regression)


# --- parameters that some steps do not reach, AdamW with weight decay -------------------------


class Branchy(nn.Module):
    """A head only some samples reach (first feature above 1.8: the global batches of seed 3
    and B = 24 hold 2, 0, 2, 0, 2, 0 of them) and a layer never called. One process leaves such
    a parameter without a gradient in a step that does not reach it, and AdamW then neither
    decays it nor moves it by its moments."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 1)
        self.aux = nn.Linear(6, 1)
        self.spare = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def branchy_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    total = (model(x) - y).pow(2).sum()
    special = x[:, 0] > 1.8
    if special.any():  # a micro-batch without such samples does not reach the head
        total = total + model.aux(x[special]).pow(2).sum()
    return total / len(x)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.5)


def unused_job() -> TrainJob:
    return TrainJob(model=Branchy, optimizer=adamw, loss=branchy_loss, dataset=regression)


class Augmented(torch.utils.data.Dataset):
    """`regression()` with noise drawn while a sample is read, from torch's, Python's and
    NumPy's global generators (as image augmentation does)."""

    def __init__(self) -> None:
        self.data = regression()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        noise = torch.rand(x.shape) * 0.1 + random.random() * 0.1 + float(np.random.rand()) * 0.1
        return x + noise, y


def augmented_job() -> TrainJob:
    """Dropout in the model and random augmentation in the data set."""
    return TrainJob(model=dropout_mlp, optimizer=sgd, loss=mse, dataset=Augmented)


def seed_all(seed: int) -> None:
    """What the README says is seeded before a group's samples are read."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))


def mlp_job(loss_scale: float = 1.0) -> TrainJob:
    """A plain MLP (no BatchNorm, no dropout); `loss_scale` multiplies the loss (a large one
    makes exact mode widen its scale)."""
    if loss_scale == 1.0:
        return TrainJob(model=mlp, optimizer=sgd, loss=mse, dataset=regression)

    def loss(model: nn.Module, batch) -> torch.Tensor:
        return mse(model, batch) * loss_scale

    def optimizer(params) -> torch.optim.Optimizer:  # the same steps as `sgd` on the mse
        return torch.optim.SGD(params, lr=0.1 / loss_scale, momentum=0.9)

    return TrainJob(model=mlp, optimizer=optimizer, loss=loss, dataset=regression)


# --- BatchNorm under activation checkpointing (the layers run again in backward) -----------


class CheckpointedCNN(nn.Module):
    def __init__(self, checkpointed: bool = True) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint

            return self.head(checkpoint(self.block, x, use_reentrant=False))
        return self.head(self.block(x))


def checkpointed_job(checkpointed: bool = True) -> TrainJob:
    return TrainJob(model=lambda: CheckpointedCNN(checkpointed), optimizer=sgd, loss=classify,
                    dataset=images)


JOBS = {"cnn_batchnorm": cnn_job, "lm_losssum": lm_job, "dropout": dropout_job,
        "random_layers": random_layers_job, "unused_params": unused_job}


def _start(job: TrainJob, seed: int, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer,
                                                                    TensorDataset]:
    """Model (built under `seed`, as a worker builds it, then moved to `device`), optimizer
    and data set, in training mode."""
    torch.manual_seed(seed)
    model = job.model().to(device)
    model.train()
    return model, job.optimizer(model.parameters()), job.dataset()


def _on(batch, device: str):
    return [t.to(device) for t in batch] if isinstance(batch, list | tuple) else batch.to(device)


def _global_batch(n: int, seed: int, global_batch: int, step: int) -> torch.Tensor:
    """The indices of step `step`'s global batch in the public order."""
    epoch, s = divmod(step, n // global_batch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return perm[s * global_batch : (s + 1) * global_batch]


def reference(job: TrainJob, seed: int, global_batch: int, group: int,
              steps: int) -> dict[str, torch.Tensor]:
    """One plain-PyTorch process: groups of `group` samples in the public order (see the
    module's docstring). Returns the final state dict (parameters and buffers)."""
    model, opt, data = _start(job, seed)
    for step in range(steps):
        idx = _global_batch(len(data), seed, global_batch, step)
        opt.zero_grad()
        count = 0.0
        for first in range(0, global_batch, group):
            seed_all(forward_seed(seed, step, first))
            batch = default_collate([data[int(i)] for i in idx[first : first + group]])
            out = job.loss(model, batch)
            if isinstance(out, LossSum):
                out.total.backward()
                count += float(out.count)
            else:
                (out * group / global_batch).backward()
        if count:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad /= count
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- exact mode: the same loop, summed in fixed point ------------------------------------------

HEADROOM = 8


def _fixed_point_sum(values: list[torch.Tensor], exponent: int, groups: int) -> tuple[torch.Tensor, int, int]:
    """Exact mode's sum of one slot over a step's groups, from the README's rules: each group's
    values rounded to integers at 2**exponent (widened while a group's do not fit in
    bits = 52 - ceil(log2 groups)), summed exactly (here in int64). Returns the float64 sum,
    the exponent used and the sum over groups of each one's largest integer."""
    bits = 52 - max(1, (groups - 1).bit_length())
    while True:
        ints, largest, overflow = [], 0, 0
        for v in values:
            q = torch.round(v.detach().reshape(-1).to(torch.float64) * 2.0 ** -exponent)
            top = int(q.abs().max()) if q.numel() else 0
            if top >= 1 << bits:
                overflow += 1 << min(int(q.abs().max()).bit_length() - bits, bits)
            ints.append(q.to(torch.int64))
            largest += top
        if not overflow:
            break
        exponent += overflow.bit_length() - 1
    total = torch.stack(ints).sum(0) if ints else torch.zeros(0, dtype=torch.int64)
    return total.to(torch.float64) * 2.0 ** exponent, exponent, largest


def exact_reference(job: TrainJob, seed: int, global_batch: int, group: int,
                    steps: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One plain-PyTorch process in exact mode: the groups of `reference`, each group's
    gradient, loss, count and BatchNorm terms computed on their own and summed in fixed point
    (`_fixed_point_sum`), every slot's exponent following the previous step's largest values.
    On `device` (a GPU: run it under `torch.use_deterministic_algorithms(True)` and without
    `cudnn.benchmark`, as exact mode's workers run); the state comes back on the CPU."""
    model, opt, data = _start(job, seed, device)
    groups = global_batch // group
    bits = 52 - max(1, (groups - 1).bit_length())
    params = [p for p in model.parameters() if p.requires_grad]
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    slots = len(params) + 2 + 2 * len(norms)
    exponents = [HEADROOM - bits] * slots
    for step in range(steps):
        idx = _global_batch(len(data), seed, global_batch, step)
        before = [(m.running_mean.clone(), m.running_var.clone(), int(m.num_batches_tracked))
                  for m in norms]
        values: list[list[torch.Tensor]] = [[] for _ in range(slots)]
        summing = False
        for j in range(groups):
            seed_all(forward_seed(seed, step, j * group))
            batch = _on(default_collate([data[int(i)] for i in idx[j * group : (j + 1) * group]]),
                        device)
            with torch.no_grad():
                for m, (_, _, tracked) in zip(norms, before, strict=True):
                    m.running_mean.zero_()
                    m.running_var.zero_()
                    m.num_batches_tracked.fill_(tracked + j)
            out = job.loss(model, batch)
            for i, (m, (_, _, tracked)) in enumerate(zip(norms, before, strict=True)):
                weight = ((1.0 - m.momentum) ** (groups - j - 1) if m.momentum is not None
                          else (tracked + j + 1) / (tracked + groups))
                values[len(params) + 2 + 2 * i].append(m.running_mean.to(torch.float64) * weight)
                values[len(params) + 3 + 2 * i].append(m.running_var.to(torch.float64) * weight)
            if isinstance(out, LossSum):
                summing = True
                loss = out.total
                values[len(params) + 1].append(torch.tensor([float(out.count)], dtype=torch.float64))
            else:
                loss = out * (group / global_batch)
            values[len(params)].append(loss.detach().reshape(1))
            loss.backward()
            for k, p in enumerate(params):
                if p.grad is not None:
                    values[k].append(p.grad)
                    p.grad = None
        sums, largest = [], []
        for k in range(slots):
            total, exponents[k], top = _fixed_point_sum(values[k], exponents[k], groups)
            sums.append(total)
            largest.append(top)
        count = float(sums[len(params) + 1][0]) if summing else None
        for k, p in enumerate(params):
            if not values[k]:  # no group reached it: no gradient, as in `reference`
                p.grad = None
                continue
            p.grad = sums[k].to(p.dtype).view_as(p)
            if count is not None:
                p.grad.div_(count)
        with torch.no_grad():
            for i, (m, (mean, var, tracked)) in enumerate(zip(norms, before, strict=True)):
                keep = ((1.0 - m.momentum) ** groups if m.momentum is not None
                        else tracked / (tracked + groups))
                m.running_mean.copy_((mean.to(torch.float64) * keep
                                      + sums[len(params) + 2 + 2 * i]).to(m.running_mean.dtype))
                m.running_var.copy_((var.to(torch.float64) * keep
                                     + sums[len(params) + 3 + 2 * i]).to(m.running_var.dtype))
                m.num_batches_tracked.fill_(tracked + groups)
        opt.step()
        opt.zero_grad(set_to_none=True)
        exponents = [e + top.bit_length() + HEADROOM - bits if top else e
                     for e, top in zip(exponents, largest, strict=True)]
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
