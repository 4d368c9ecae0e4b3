"""A small CNN on synthetic 1x28x28 images (ten classes, each a noisy fixed pattern):

    elastic run examples/cnn.py:job --workers 2 --epochs 3 --global-batch 64 --max-micro-batch 16
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic import TrainJob


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    patterns = torch.randn(10, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (2048,), generator=g)
    x = patterns[labels] + 0.8 * torch.randn(2048, 1, 28, 28, generator=g)
    return TensorDataset(x, labels)


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 7 * 7, 10),
    )


def loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def accuracy(model: nn.Module) -> dict[str, float]:
    x, y = images().tensors
    return {"accuracy": float((model(x).argmax(1) == y).float().mean())}


job = TrainJob(model=cnn, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss=loss,
               dataset=images, evaluate=accuracy)
