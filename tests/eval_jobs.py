"""The regression job of `tests/jobs.py` with an evaluation set and `eval_step`, and a plain
single-process evaluation (no project code) to hold distributed evaluations to."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic import LossSum, TrainJob
from tests.jobs import N_FEATURES, make_dataset, make_model, make_optimizer, mse, reference_weights

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


def eval_job(step=eval_step) -> TrainJob:
    return TrainJob(model=make_model, optimizer=make_optimizer, loss=mse, dataset=make_dataset,
                    eval_dataset=make_eval_dataset, eval_step=step)


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
