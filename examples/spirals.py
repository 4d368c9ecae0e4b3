"""Demo job: classify two interleaved spirals with a small MLP.

    elastic run examples/spirals.py:job --workers 4 --epochs 8 --global-batch 64 --kill-at 20:1
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic import TrainJob

N_PER_CLASS = 1024


def spirals() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    t = torch.rand(N_PER_CLASS, generator=g) * 3 * math.pi + 0.5
    xs, ys = [], []
    for label, phase in ((0, 0.0), (1, math.pi)):
        x = torch.stack([t * torch.cos(t + phase), t * torch.sin(t + phase)], dim=1) / 10
        xs.append(x + 0.02 * torch.randn(x.shape, generator=g))
        ys.append(torch.full((N_PER_CLASS,), label))
    return TensorDataset(torch.cat(xs), torch.cat(ys))


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def loss(m: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(m(x), y)


def evaluate(m: nn.Module) -> dict[str, float]:
    x, y = spirals().tensors
    return {"accuracy": float((m(x).argmax(1) == y).float().mean())}


job = TrainJob(model=model, optimizer=optimizer, loss=loss, dataset=spirals, evaluate=evaluate)
