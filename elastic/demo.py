"""`elastic demo`: handwritten digits (scikit-learn's bundled data set), a small MLP, 4
workers; one worker is killed part-way, a replacement joins later, and the final accuracy is
compared with an uninterrupted run of the same job."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic.api import fit
from elastic.config import BatchConfig, ChaosEvent, FitConfig, ScalingConfig
from elastic.job import TrainJob
from elastic.result import FitResult


def digits() -> TensorDataset:
    """The 1,797 8x8 digit images that ship with scikit-learn, scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    return TensorDataset(x, torch.tensor(data.target, dtype=torch.long))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def accuracy(model: nn.Module) -> dict[str, float]:
    x, y = digits().tensors
    return {"accuracy": float((model(x).argmax(1) == y).float().mean())}


def digits_job() -> TrainJob:
    return TrainJob(model=mlp, optimizer=sgd, loss=cross_entropy, dataset=digits, evaluate=accuracy)


@dataclass
class DemoResult:
    elastic: FitResult
    uninterrupted: FitResult

    def max_weight_difference(self) -> float:
        """The largest absolute difference between the final weights of the two runs."""
        a, b = self.elastic.model_state, self.uninterrupted.model_state
        assert a.keys() == b.keys()
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def run_demo(workers: int = 4, epochs: int = 30, kill_step: int = 30, kill_rank: int = 1,
             run_dir: str | None = None) -> DemoResult:
    """Runs the job twice: with a worker killed at `kill_step`, and uninterrupted."""
    base = run_dir or tempfile.mkdtemp(prefix="elastic-demo-")
    common = {"scaling": ScalingConfig(num_workers=workers, min_workers=1),
              "batch": BatchConfig(global_batch_size=64), "epochs": epochs}
    chaos = (ChaosEvent(step=kill_step, rank=kill_rank, action="kill", phase="backward"),)
    hit = fit(digits_job(), FitConfig(**common, chaos=chaos, run_dir=os.path.join(base, "elastic")))
    clean = fit(digits_job(), FitConfig(**common, run_dir=os.path.join(base, "uninterrupted")))
    return DemoResult(elastic=hit, uninterrupted=clean)
