"""The models people train, small: a CNN with BatchNorm, a padded-token language model with a
sum-and-count loss, an MLP with dropout (float32, as users train them), and a plain-PyTorch
reference loop that does not use the project's training code.

The reference is what the README promises an elastic run equals: one process, the public
sample order (`perm_e = randperm(N, seed + e)`, step s of epoch e takes `perm_e[s*B:(s+1)*B]`),
the global batch cut into groups of G consecutive samples, one forward per group with the
random-number generators seeded by `elastic.forward_seed(seed, step, j * G)` before group j's
samples are loaded; a scalar loss scaled by G/B, a `LossSum` total backpropagated as is and the
gradients divided by the summed count before the optimizer step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset, default_collate

from elastic import LossSum, TrainJob, forward_seed

N = 96
PAD = 0
VOCAB = 11
SEQ = 8


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# --- a CNN with BatchNorm (one layer with momentum None: a cumulative average) ---------------


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(N, 3, 6, 6, generator=g), torch.randint(0, 4, (N,), generator=g))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))


def classify(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def cnn_job() -> TrainJob:
    return TrainJob(model=cnn, optimizer=sgd, loss=classify, dataset=images)


# --- a padded-token language model with a sum-and-count loss ----------------------------------


def tokens() -> TensorDataset:
    """Sequences of 1 to SEQ tokens, padded with PAD; y is x shifted (PAD where padded)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randint(1, VOCAB, (N, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (N,), generator=g)
    pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
    y = torch.roll(x, -1, dims=1)
    x[pad] = PAD
    y[pad | (torch.arange(SEQ)[None, :] == SEQ - 1)] = PAD
    return TensorDataset(x, y)


def lm() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, VOCAB))


def token_loss(model: nn.Module, batch) -> LossSum:
    x, y = batch
    logits = model(x)
    total = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=PAD,
                            reduction="sum")
    return LossSum(total, (y != PAD).sum())


def lm_job() -> TrainJob:
    return TrainJob(model=lm, optimizer=sgd, loss=token_loss, dataset=tokens)


# --- an MLP with dropout -----------------------------------------------------------------------


def regression() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, x @ torch.randn(6, 1, generator=g))


def dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def dropout_job() -> TrainJob:
    return TrainJob(model=dropout_mlp, optimizer=sgd, loss=mse, dataset=regression)


# --- BatchNorm under activation checkpointing (the layers run again in backward) -----------


class CheckpointedCNN(nn.Module):
    def __init__(self, checkpointed: bool = True) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint

            return self.head(checkpoint(self.block, x, use_reentrant=False))
        return self.head(self.block(x))


def checkpointed_job(checkpointed: bool = True) -> TrainJob:
    return TrainJob(model=lambda: CheckpointedCNN(checkpointed), optimizer=sgd, loss=classify,
                    dataset=images)


JOBS = {"cnn_batchnorm": cnn_job, "lm_losssum": lm_job, "dropout": dropout_job}


def reference(job: TrainJob, seed: int, global_batch: int, group: int,
              steps: int) -> dict[str, torch.Tensor]:
    """One plain-PyTorch process: groups of `group` samples in the public order (see the
    module's docstring). Returns the final state dict (parameters and buffers)."""
    torch.manual_seed(seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    data = job.dataset()
    n = len(data)
    per_epoch = n // global_batch
    model.train()
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        idx = perm[s * global_batch : (s + 1) * global_batch]
        opt.zero_grad()
        count = 0.0
        for first in range(0, global_batch, group):
            torch.manual_seed(forward_seed(seed, step, first))
            batch = default_collate([data[int(i)] for i in idx[first : first + group]])
            out = job.loss(model, batch)
            if isinstance(out, LossSum):
                out.total.backward()
                count += float(out.count)
            else:
                (out * group / global_batch).backward()
        if count:
            for p in model.parameters():
                p.grad /= count
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
