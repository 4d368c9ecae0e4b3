"""`elastic bench drift`: how far the default mode's weights drift from one plain process as a
run gets longer, with no fault at all.

A small CNN with BatchNorm (one layer with a cumulative average) on random 6x6 images, global
batch 24 in groups of 12 (the BatchNorm groups), trained by `elastic.fit` on `workers` workers
for each number of steps asked, against a plain PyTorch loop over the same global batches in
the public order, one group after the other. In the default mode the gradients of a step are
summed over ranks in another order than one process sums them, so the weights differ in the
last bits after one step; training amplifies that over many steps. The bench reports the
largest absolute weight difference per run length. (Exact mode does not drift: its sums do
not depend on the split.)
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset, default_collate

N, B, G, SEED = 240, 24, 12, 0


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(N, 3, 6, 6, generator=g), torch.randint(0, 4, (N,), generator=g))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def classify(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def plain(steps: int) -> dict[str, torch.Tensor]:
    """One process: each step's global batch in the public order (a permutation of the data
    per epoch, seeded by seed + epoch), groups of G one after the other, each group's mean
    loss weighted by G / B."""
    torch.manual_seed(SEED)
    model, data = cnn(), images()
    model.train()
    opt = sgd(model.parameters())
    for step in range(steps):
        epoch, s = divmod(step, N // B)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))
        idx = perm[s * B : (s + 1) * B]
        opt.zero_grad()
        for first in range(0, B, G):
            batch = default_collate([data[int(i)] for i in idx[first : first + G]])
            (classify(model, batch) * G / B).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class DriftPoint:
    steps: int
    max_weight_difference: float


def run_drift(steps: list[int], workers: int = 2) -> list[DriftPoint]:
    """`elastic.fit` for each number of steps against `plain` for as many."""
    from elastic.api import fit
    from elastic.config import BatchConfig, FitConfig, LoggingConfig, ScalingConfig
    from elastic.job import TrainJob

    job = TrainJob(model=cnn, optimizer=sgd, loss=classify, dataset=images)
    points = []
    for n in steps:
        config = FitConfig(scaling=ScalingConfig(num_workers=workers),
                           batch=BatchConfig(global_batch_size=B, group_size=G, autotune=False,
                                             rebalance=False),
                           max_steps=n, seed=SEED, logging=LoggingConfig(progress="off"),
                           run_dir=tempfile.mkdtemp(prefix="bench-drift-"))
        result = fit(job, config)
        reference = plain(n)
        diff = max(float((result.model_state[k].double() - v.double()).abs().max())
                   for k, v in reference.items() if v.is_floating_point())
        points.append(DriftPoint(n, diff))
    return points
