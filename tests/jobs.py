"""Small training jobs for integration and fault tests, plus a plain-PyTorch reference loop
that does not use the project's training code.

float64 throughout: runs of hundreds of steps at changing world sizes then match the
reference to ~1e-10, so any skipped, repeated or misweighted sample shows."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic import TrainJob

N_SAMPLES = 96
N_FEATURES = 6


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g, dtype=torch.float64)
    w = torch.randn(N_FEATURES, 1, generator=g, dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(N_SAMPLES, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def evaluate(model: nn.Module) -> dict[str, float]:
    x, y = make_dataset().tensors
    return {"mse": float(nn.functional.mse_loss(model(x), y))}


def regression_job() -> TrainJob:
    return TrainJob(model=make_model, optimizer=make_optimizer, loss=mse, dataset=make_dataset,
                    evaluate=evaluate)


class FlakyLoss:
    """A loss that raises on every call on the worker whose dataset index 0 is in its
    micro-batch (a user bug that depends on the data)."""

    def __call__(self, model, batch):
        raise ValueError("user bug in the loss")


def failing_job() -> TrainJob:
    return TrainJob(model=make_model, optimizer=make_optimizer, loss=FlakyLoss(),
                    dataset=make_dataset)


def reference_weights(seed: int, global_batch: int, steps: int) -> dict[str, torch.Tensor]:
    """One process, batch B, the public sample order; written without project code."""
    torch.manual_seed(seed)
    model = make_model()
    opt = make_optimizer(model.parameters())
    x, y = make_dataset().tensors
    per_epoch = N_SAMPLES // global_batch
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch))
        idx = perm[s * global_batch : (s + 1) * global_batch]
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
