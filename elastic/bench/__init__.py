"""Benchmarks behind `elastic bench ...`: each returns a result the CLI prints and saves."""

from __future__ import annotations

import torch
from torch import nn


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The benchmarks' loss: cross-entropy of `model(inputs)` against integer labels."""
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def sgd(params, lr: float = 0.01, momentum: float = 0.0) -> torch.optim.Optimizer:
    """The benchmarks' optimizer (bind `lr`/`momentum` with functools.partial)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum)
