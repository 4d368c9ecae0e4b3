"""A job for sharded optimizer state (an MLP with a LayerNorm, AdamW with decay groups or SGD
with momentum, a warm-up schedule, clipping) and its plain single-process reference."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic import TrainJob

B = 24
SEED = 5
N = 96


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, x[:, :2].sum(1, keepdim=True) * 0.5 + 0.1)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 16),
                         nn.ReLU(), nn.Linear(16, 1))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with the usual groups: no weight decay on biases and norms."""
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=0.01)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def warmup(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def job(optimizer=adamw) -> TrainJob:
    return TrainJob(model=model, optimizer=optimizer, loss=mse, dataset=data,
                    lr_scheduler=warmup)


def reference(optimizer, steps: int) -> dict[str, torch.Tensor]:
    """One plain-PyTorch process over the public sample order: the global batch's mean loss,
    clipping at 0.5, the scheduler after every step."""
    torch.manual_seed(SEED)
    net = model()
    opt = optimizer(net)
    scheduler = warmup(opt)
    samples = data()
    for step in range(steps):
        epoch, offset = divmod(step * B, N)
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))
        x, y = samples[perm[offset : offset + B]]
        opt.zero_grad()
        mse(net, (x, y)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        scheduler.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}
