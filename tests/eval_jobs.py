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
    ex, ey = make_eval_dataset().tensors
    lrs: list[float] = []
    schedulers: list = []

    def after_step(step, model, opt):
        if not schedulers:
            schedulers.append(halving_plateau(opt))
        lrs.append(opt.param_groups[0]["lr"])  # the rate this step used
        if (step + 1) % every == 0:
            with torch.no_grad():
                schedulers[0].step(float(((model(ex) - ey) ** 2).mean()))

    return reference_weights(seed, global_batch, steps, after_step), lrs


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
