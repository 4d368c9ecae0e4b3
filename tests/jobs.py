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
    # The model is on the worker's device (a GPU with scaling.use_gpu): the inputs go there.
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in make_dataset().tensors)
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


def reference_weights(seed: int, global_batch: int, steps: int,
                      after_step=None, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One process, batch B, the public sample order; written without project code.
    `after_step(step, model, optimizer)`, if given, runs after each optimizer step. On
    `device` (a GPU's kernels for a GPU run); the weights come back on the CPU."""
    torch.manual_seed(seed)
    model = make_model().to(device)
    opt = make_optimizer(model.parameters())
    x, y = (t.to(device) for t in make_dataset().tensors)
    per_epoch = N_SAMPLES // global_batch
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch))
        idx = perm[s * global_batch : (s + 1) * global_batch]
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        if after_step is not None:
            after_step(step, model, opt)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def reference_run(job: TrainJob, seed: int, batches: list[int],
                  lrs: list[float] | None = None) -> dict[str, torch.Tensor]:
    """One process, the public sample order with a global batch per step (`batches`) and, if
    given, the learning rate of each step (`lrs`); written without project code."""
    torch.manual_seed(seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    data = job.dataset()
    n = len(data)
    epoch, offset = 0, 0
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    for step, b in enumerate(batches):
        if offset + b > n:
            epoch, offset = epoch + 1, 0
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        idx = perm[offset : offset + b]
        offset += b
        samples = [data[int(i)] for i in idx]
        batch = [torch.stack([s[k] for s in samples]) for k in range(len(samples[0]))]
        opt.zero_grad()
        job.loss(model, batch).backward()
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[step]
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


WIDE_SAMPLES = 4096


def make_wide_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(WIDE_SAMPLES, 64, generator=g, dtype=torch.float64)
    y = torch.tanh(x[:, :1]) + 0.1 * torch.randn(WIDE_SAMPLES, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def make_wide_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 384), nn.Tanh(), nn.Linear(384, 384), nn.Tanh(),
                         nn.Linear(384, 1)).double()


def wide_job() -> TrainJob:
    """Compute-heavy enough (per sample) that a slowed rank shows in the step time."""
    return TrainJob(model=make_wide_model, optimizer=make_optimizer, loss=mse,
                    dataset=make_wide_dataset)


POISONED = 37  # the sample whose target is NaN in `poisoned_job`


def make_poisoned_dataset() -> TensorDataset:
    x, y = make_dataset().tensors
    y = y.clone()
    y[POISONED] = float("nan")
    return TensorDataset(x, y)


def poisoned_job() -> TrainJob:
    """The regression job with one NaN target: every step that holds sample POISONED has a
    NaN loss on the rank that holds it."""
    return TrainJob(model=make_model, optimizer=make_optimizer, loss=mse,
                    dataset=make_poisoned_dataset)


def reference_skipping_nonfinite(seed: int, global_batch: int, steps: int) -> dict[str, torch.Tensor]:
    """Like `reference_weights` on the poisoned data, dropping every update whose loss is not
    finite (the samples are consumed all the same)."""
    torch.manual_seed(seed)
    model = make_model()
    opt = make_optimizer(model.parameters())
    x, y = make_poisoned_dataset().tensors
    per_epoch = N_SAMPLES // global_batch
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch))
        idx = perm[s * global_batch : (s + 1) * global_batch]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        if not torch.isfinite(loss):
            continue
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def poisoned_steps(seed: int, global_batch: int, steps: int) -> list[tuple[int, int]]:
    """(step, position in the global batch) of every step that holds sample POISONED."""
    per_epoch = N_SAMPLES // global_batch
    found = []
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        perm = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch))
        idx = perm[s * global_batch : (s + 1) * global_batch].tolist()
        if POISONED in idx:
            found.append((step, idx.index(POISONED)))
    return found


class CorruptSample(torch.utils.data.Dataset):
    """32 samples of 6 features; sample 7 cannot be read (a corrupt record)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        if i == 7:
            raise ValueError("sample 7 is corrupt")
        return torch.full((N_FEATURES,), float(i), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)


def corrupt_job() -> TrainJob:
    return TrainJob(model=make_model, optimizer=make_optimizer, loss=mse, dataset=CorruptSample)


def make_shuffled_dataset() -> TensorDataset:
    """A data set whose factory draws from Python's and NumPy's generators (a shuffle of its
    files, a split without a fixed seed), as user code often does."""
    import random

    import numpy as np

    order = torch.from_numpy(np.random.permutation(64))
    offset = random.random()
    return TensorDataset(order.double().unsqueeze(1) + offset, order.double().unsqueeze(1))


def shuffled_job() -> TrainJob:
    return TrainJob(model=make_model, dataset=make_shuffled_dataset, loss=mse,
                    optimizer=make_optimizer)


def _unreadable():
    import multiprocessing

    if multiprocessing.parent_process() is None:  # the worker (here: the test's process)
        raise OSError("no file descriptors left")
    return Unreadable()


class Unreadable:
    """Pickles in a loader process; cannot be unpickled in the worker that reads the reply."""

    def __reduce__(self):
        return (_unreadable, ())


class UnreadableSamples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return Unreadable() if i < 32 else torch.tensor(float(i))


def unreadable_job() -> TrainJob:
    return TrainJob(model=make_model, dataset=UnreadableSamples, loss=mse,
                    optimizer=make_optimizer, collate_fn=list)
