"""The regression job of `tests/jobs.py` with an evaluation set and `eval_step`, and a plain
single-process evaluation (no project code) to hold distributed evaluations to."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic import LossSum, TrainJob
from tests.jobs import (
    N_FEATURES,
    N_SAMPLES,
    make_dataset,
    make_model,
    make_optimizer,
    mse,
    reference_weights,
)

N_EVAL = 37  # not a multiple of any batch or world size in the tests


def make_eval_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(N_EVAL, N_FEATURES, generator=g, dtype=torch.float64)
    y = x.sum(1, keepdim=True) + 0.3 * torch.randn(N_EVAL, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def eval_step(model: nn.Module, batch) -> dict:
    x, y = batch
    err = model(x) - y
    return {"mse": ((err ** 2).sum(), err.numel()), "mae": LossSum(err.abs().sum(), len(x))}


def slow_eval_step(model: nn.Module, batch) -> dict:
    """`eval_step` that takes half a second a batch (a slow evaluation, not a hung one)."""
    time.sleep(0.5)
    return eval_step(model, batch)


def eval_job(step=eval_step, lr_scheduler=None) -> TrainJob:
    return TrainJob(model=make_model, optimizer=make_optimizer, loss=mse, dataset=make_dataset,
                    eval_dataset=make_eval_dataset, eval_step=step, lr_scheduler=lr_scheduler)


def halving_plateau(optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    """A plateau scheduler that halves the rate at every evaluation whose mse is not below the
    best so far (with this job's rate the mse at step 8 is above step 4's: the rate halves)."""
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5,
                                                      patience=0)


def reference_with_eval_plateau(seed: int, global_batch: int, steps: int,
                                every: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The plain loop of `reference_weights` with `halving_plateau` stepped on the whole
    evaluation set's mse after every `every` steps; returns the weights and each step's rate.
    Written without project code."""
    torch.manual_seed(seed)
    model = make_model()
    opt = make_optimizer(model.parameters())
    scheduler = halving_plateau(opt)
    x, y = make_dataset().tensors
    ex, ey = make_eval_dataset().tensors
    per_epoch = N_SAMPLES // global_batch
    lrs = []
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch))
        idx = perm[s * global_batch : (s + 1) * global_batch]
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        if (step + 1) % every == 0:
            with torch.no_grad():
                scheduler.step(float(((model(ex) - ey) ** 2).mean()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, lrs


def reference_metrics(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The metrics of a model with weights `state` over the whole evaluation set at once."""
    model = make_model()
    model.load_state_dict(state)
    x, y = make_eval_dataset().tensors
    with torch.no_grad():
        err = model(x) - y
    return {"mse": float((err ** 2).mean()), "mae": float(err.abs().mean())}


def reference_metrics_at(seed: int, global_batch: int, step: int) -> dict[str, float]:
    """The metrics of the plain-PyTorch reference model after `step` steps."""
    return reference_metrics(reference_weights(seed, global_batch, step))
