"""`elastic bench step`: what elastic's step costs beside a plain PyTorch step, in one process.

A step of elastic's replica at one worker (a real communicator of one rank, no Ray, no loader
processes) against a plain loop's step (forward, backward, optimizer step, one read of the
loss), on the same model, optimizer and batch, on the CPU or a GPU. The model is a CNN of
`depth` convolution + BatchNorm blocks (ResNet-50 has 53 BatchNorm layers and 161 parameter
tensors): the step's own work (BatchNorm statistics, gradients, finiteness, metadata) is
CPU time, and on a GPU, where the model's kernels run asynchronously, a step whose CPU time
exceeds its GPU time is CPU-bound. So the bench reports, per runner, the median time per
step, and the tensor operations per step (each a kernel launch on a GPU, views aside),
counted with a dispatch mode over one more step. The elastic step's operations beyond the
plain step's should not grow with `depth`.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset, default_collate

# Operations that launch no kernel on a GPU: views and metadata.
VIEWS = frozenset({"view", "_unsafe_view", "slice", "select", "detach", "alias", "unbind",
                   "split", "split_with_sizes", "reshape", "_reshape_alias", "expand",
                   "as_strided", "t", "transpose", "permute", "squeeze", "unsqueeze",
                   "lift_fresh"})


class _Ops(TorchDispatchMode):
    """Counts the tensor operations run under it that are not views."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class _Deep:
    """A CNN of `depth` blocks (a picklable factory, as `TrainJob.model` wants)."""

    depth: int
    width: int

    def __call__(self) -> nn.Module:
        w = self.width
        layers: list[nn.Module] = [nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU()]
        for _ in range(self.depth):
            layers += [nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w, 10))


@dataclass(frozen=True)
class _Images:
    samples: int
    size: int

    def __call__(self) -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(self.samples, 3, self.size, self.size, generator=g),
                             torch.randint(0, 10, (self.samples,), generator=g))


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


@dataclass
class StepRow:
    runner: str
    depth: int
    ms_per_step: float
    vs_plain: float
    operations: int  # tensor operations per step, views aside
    beyond_plain: int


def _timed(step, steps: int, warmup: int, device: torch.device) -> float:
    """Median seconds per call of `step` over `steps` calls after `warmup` (the device's
    queue drained around each)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _counted(step) -> Counter[str]:
    with _Ops() as ops:
        step()
    return ops.counts


def _plain(depth: int, width: int, batch: int, size: int, device: torch.device, steps: int,
           warmup: int) -> tuple[float, Counter[str]]:
    torch.manual_seed(0)
    model = _Deep(depth, width)().to(device)
    optimizer = _sgd(model.parameters())
    # The batch read as a plain loop over a DataLoader without loader processes reads it,
    # each step: the samples indexed one by one, stacked, copied to the device (before, the
    # plain step used one batch already there, while elastic's read and copied its own: the
    # difference was partly the data's, not the step's).
    dataset = _Images(batch * 64, size)()
    order = iter(range(1 << 62))

    def step() -> None:
        first = next(order) * batch % len(dataset)
        x, y = default_collate([dataset[i] for i in range(first, first + batch)])
        loss = _loss(model, (x.to(device), y.to(device)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # one read of the loss per step, as a loop that logs it

    model.train()
    return _timed(step, steps, warmup, device), _counted(step)


def _elastic(depth: int, width: int, batch: int, size: int, device: torch.device, steps: int,
             warmup: int) -> tuple[float, Counter[str]]:
    from elastic.adapt.plan import BatchPlan
    from elastic.collective import Communicator, RendezvousServer
    from elastic.config import BatchConfig, CollectiveConfig, FitConfig, ScalingConfig
    from elastic.job import TrainJob
    from elastic.trainer.replica import Replica, StepRecord

    job = TrainJob(model=_Deep(depth, width), optimizer=_sgd, loss=_loss,
                   dataset=_Images(batch * 64, size))
    gpu = device.type == "cuda"
    config = FitConfig(scaling=ScalingConfig(num_workers=1, use_gpu=gpu),
                       collective=CollectiveConfig(backend="gloo"),
                       batch=BatchConfig(global_batch_size=batch, max_micro_batch=batch,
                                         autotune=False, rebalance=False),
                       run_dir=tempfile.mkdtemp(prefix="bench-step-"), max_steps=1 << 30)
    if gpu:
        torch.cuda.set_device(device)
    replica = Replica(job, config, config.run_dir, device)
    server = RendezvousServer()
    comm = Communicator(0, 1, server.endpoint, 0, config.collective, secret=server.secret)
    replica.comm = comm
    plan = BatchPlan(batch, (batch,), (batch,))

    def step() -> None:
        record = replica.run_step(plan, [])
        if not isinstance(record, StepRecord):
            raise RuntimeError(f"bench step: a step was not committed: {record}")

    try:
        return _timed(step, steps, warmup, device), _counted(step)
    finally:
        replica.close()
        comm.close()
        server.close()


def run_step_bench(depths: list[int], device: str = "cpu", width: int = 8, batch: int = 8,
                   size: int = 8, steps: int = 30, warmup: int = 5) -> list[StepRow]:
    """For each depth: the plain step and elastic's at one worker, timed and counted."""
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", 0)
    rows = []
    for depth in depths:
        plain_s, plain_ops = _plain(depth, width, batch, size, where, steps, warmup)
        elastic_s, elastic_ops = _elastic(depth, width, batch, size, where, steps, warmup)
        base = sum(plain_ops.values())
        rows.append(StepRow("plain PyTorch", depth, plain_s * 1e3, 1.0, base, 0))
        total = sum(elastic_ops.values())
        rows.append(StepRow("elastic, 1 worker", depth, elastic_s * 1e3, plain_s / elastic_s,
                            total, total - base))
    return rows
