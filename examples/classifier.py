"""A complete image classifier: bf16 autocast, gradient clipping, AdamW with weight decay on
the weights only (parameter groups by name), a cosine schedule, accuracy as a training metric,
evaluation of a held-out folder every 20 steps split over the workers, the best checkpoint by
evaluation accuracy kept, TensorBoard. The settings are in `examples/classifier.toml`:

    elastic run examples/classifier.py:job --config examples/classifier.toml --workers 2 --max-steps 60

`job()` writes two small synthetic image folders (training and held-out; see
`examples/images.py`) under `ELASTIC_EXAMPLE_IMAGES` (default: the temporary directory).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from images import ImageFolder, model, write_folder

from elastic import TrainJob

STEPS = 60  # the cosine schedule's length: the run's --max-steps


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Weight decay on weights, none on biases and BatchNorm (groups built from the names)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                              {"params": rest, "weight_decay": 0.0}], lr=3e-3)


def cosine(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, STEPS) / STEPS)))


def loss(m: nn.Module, batch):
    """The mean cross-entropy, and the accuracy as a training metric."""
    x, y = batch
    logits = m(x)
    return F.cross_entropy(logits, y), {"accuracy": (logits.argmax(1) == y).float().mean()}


def eval_step(m: nn.Module, batch) -> dict:
    """Sums and counts over the batch: the evaluation reports sum / count over the set."""
    x, y = batch
    logits = m(x)
    return {"loss": (F.cross_entropy(logits, y, reduction="sum"), len(y)),
            "accuracy": ((logits.argmax(1) == y).sum(), len(y))}


def job() -> TrainJob:
    base = os.environ.get("ELASTIC_EXAMPLE_IMAGES",
                          os.path.join(tempfile.gettempdir(), f"elastic-example-images-{os.getuid()}"))
    train, held_out = base, f"{base}-held-out"
    write_folder(train)
    write_folder(held_out, per_class=16, seed=1)
    return TrainJob(model=model, optimizer=optimizer, loss=loss, lr_scheduler=cosine,
                    dataset=lambda: ImageFolder(train), eval_dataset=lambda: ImageFolder(held_out),
                    eval_step=eval_step)
