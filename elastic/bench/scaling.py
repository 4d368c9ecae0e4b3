"""`elastic bench scaling`: samples/s against workers and global batch, with scaling
efficiency, for the seed studies' models on synthetic data; plus a projection to 8-256
workers from the measured compute time per sample and an alpha-beta allreduce model fitted
to the measured communication times.

Models (reduced in size for a CPU): `mlp95`, the HAL talk's fully connected network on
MNIST-shaped data (784 -> 95 -> 10; 12700, 10264, 7146 img/s at 1, 2, 4 GPUs with global
batch 20, where allreduce dominated), and CNNs in the style of the Horovod study: `alexnet`
(wide convolutions, large dense layers: communication-heavy), `googlenet` (inception blocks)
and `resnet50` (bottleneck residual blocks), all on 3x32x32 images.
"""

from __future__ import annotations

import functools
import math
import statistics
import tempfile
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic.api import connect, fit
from elastic.bench import classification_loss, sgd
from elastic.config import BatchConfig, FitConfig, ScalingConfig
from elastic.job import TrainJob

MODELS = ("mlp95", "alexnet", "googlenet", "resnet50")
SAMPLES = 4096


class _Inception(nn.Module):
    def __init__(self, cin: int, c: int) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(cin, c, 1)
        self.b3 = nn.Sequential(nn.Conv2d(cin, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(cin, c // 2, 1), nn.ReLU(), nn.Conv2d(c // 2, c, 5, padding=2))
        self.pool = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(cin, c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.cat([self.b1(x), self.b3(x), self.b5(x), self.pool(x)], 1))


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.skip = (nn.Identity() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def make_model(name: str) -> nn.Module:
    if name == "mlp95":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 95), nn.ReLU(), nn.Linear(95, 10))
    if name == "alexnet":
        return nn.Sequential(
            nn.Conv2d(3, 48, 5, 2, 2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(48, 96, 3, padding=1), nn.ReLU(), nn.Conv2d(96, 96, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(96 * 4 * 4, 1024), nn.ReLU(),
            nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10),
        )
    if name == "googlenet":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            _Inception(32, 16), _Inception(64, 24), nn.MaxPool2d(2), _Inception(96, 32),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
        )
    if name == "resnet50":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            _Bottleneck(32, 16, 64, 1), _Bottleneck(64, 16, 64, 1),
            _Bottleneck(64, 32, 128, 2), _Bottleneck(128, 32, 128, 1),
            _Bottleneck(128, 64, 256, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10),
        )
    raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {name!r}")


def make_dataset(name: str) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    shape = (SAMPLES, 1, 28, 28) if name == "mlp95" else (SAMPLES, 3, 32, 32)
    return TensorDataset(torch.randn(*shape, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g))



_optimizer = functools.partial(sgd, momentum=0.9)


@dataclass
class ScalingPoint:
    workers: int
    global_batch_size: int
    samples_per_s: float
    step_s: float
    compute_s: float
    comm_s: float
    efficiency: float  # samples/s over (workers x samples/s at 1 worker, same batch)


@dataclass
class Projection:
    workers: int
    samples_per_s: float
    efficiency: float


@dataclass
class ScalingResult:
    model: str
    parameters: int
    gradient_bytes: int
    points: list[ScalingPoint]
    compute_per_sample_s: float
    alpha_s: float
    beta_s_per_byte: float
    projection_batch: int
    projection: list[Projection]

    def to_json(self) -> dict:
        return asdict(self)


def fit_alpha_beta(samples: list[tuple[int, float]], nbytes: int) -> tuple[float, float]:
    """Least-squares alpha, beta of the ring model t = 2(n-1) alpha + 2(n-1)/n bytes beta from
    (world size, exposed communication seconds) pairs with n > 1; if noise makes one
    coefficient negative, it is 0 and the other is fitted alone."""
    rows = [(2 * (n - 1), 2 * (n - 1) / n * nbytes, t) for n, t in samples if n > 1]
    if not rows:
        return 0.0, 0.0
    if len({(a, b) for a, b, _ in rows}) < 2:
        # One world size: alpha and beta cannot be told apart; charge it all to bandwidth.
        b = rows[0][1]
        return 0.0, statistics.median(t for _, _, t in rows) / b if b else 0.0
    saa = sum(a * a for a, _, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    sat = sum(a * t for a, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    det = saa * sbb - sab * sab
    if abs(det) < 1e-30:
        return max(0.0, sat / saa), 0.0
    alpha = (sat * sbb - sbt * sab) / det
    beta = (saa * sbt - sab * sat) / det
    # Noise can make one coefficient negative: refit the other alone.
    if alpha < 0:
        return 0.0, max(0.0, sbt / sbb)
    if beta < 0:
        return max(0.0, sat / saa), 0.0
    return alpha, beta


def project(workers: int, batch: int, compute_per_sample: float, alpha: float, beta: float,
            nbytes: int) -> float:
    """Projected samples/s: compute of B/n samples plus a ring allreduce (no overlap)."""
    comm = 2 * (workers - 1) * alpha + 2 * (workers - 1) / workers * nbytes * beta if workers > 1 else 0.0
    return batch / (compute_per_sample * batch / workers + comm)


def run_scaling_bench(model: str, workers: list[int], batches: list[int], steps: int = 24,
                      warmup: int = 6, projection_workers: tuple[int, ...] = (8, 16, 32, 64, 128, 256),
                      ) -> ScalingResult:
    """One `elastic.fit` run per (workers, global batch); medians leave out `warmup` steps.

    Raises:
        ValueError: an unknown model, or no sizes.
    """
    make_model(model)  # validates the name
    if not workers or not batches or steps <= warmup + 2:
        raise ValueError("give worker counts, batch sizes and more steps than warm-up + 2")
    net = make_model(model)
    parameters = sum(p.numel() for p in net.parameters())
    nbytes = parameters * 4
    job = TrainJob(model=lambda: make_model(model), optimizer=_optimizer, loss=classification_loss,
                   dataset=lambda: make_dataset(model))
    # A local cluster is sized by the first run that starts it: size it for the largest point,
    # or a 4-worker point after a 1-worker one would train with the machine's cores' worth.
    connect(FitConfig(scaling=ScalingConfig(num_workers=max(workers)),
                      batch=BatchConfig(global_batch_size=max(batches)), max_steps=steps))
    points: list[ScalingPoint] = []
    for batch in batches:
        base = None
        for n in sorted(workers):  # the 1-worker point first: the others' efficiency base
            config = FitConfig(
                scaling=ScalingConfig(num_workers=n),
                batch=BatchConfig(global_batch_size=batch, autotune=False, rebalance=False),
                max_steps=steps, steps_per_chunk=steps,
                run_dir=tempfile.mkdtemp(prefix="elastic-bench-scaling-"),
            )
            metrics = [m for m in fit(job, config).metrics if m["step"] >= warmup]
            sizes = {m["world_size"] for m in metrics}
            if sizes != {n}:
                raise ValueError(f"the {n}-worker point trained with {sorted(sizes)} workers: the "
                                 "cluster has too few CPUs for it")
            step = statistics.median(m["step_time_s"] for m in metrics)
            rate = batch / step
            base = base if base is not None else (rate if n == 1 else None)
            points.append(ScalingPoint(
                workers=n, global_batch_size=batch, samples_per_s=rate, step_s=step,
                compute_s=statistics.median(m["forward_backward_s"] + m["data_s"] for m in metrics),
                comm_s=statistics.median(m["comm_s"] for m in metrics),
                efficiency=rate / (n * base) if base else math.nan,
            ))
    singles = [p for p in points if p.workers == 1]
    compute_per_sample = (statistics.median(p.compute_s / p.global_batch_size for p in singles)
                          if singles else statistics.median(p.compute_s * p.workers / p.global_batch_size
                                                            for p in points))
    alpha, beta = fit_alpha_beta([(p.workers, p.comm_s) for p in points], nbytes)
    projection_batch = max(batches)
    base_rate = project(1, projection_batch, compute_per_sample, alpha, beta, nbytes)
    projection = [Projection(n, r := project(n, projection_batch, compute_per_sample, alpha, beta, nbytes),
                             r / (n * base_rate)) for n in projection_workers]
    return ScalingResult(model=model, parameters=parameters, gradient_bytes=nbytes, points=points,
                         compute_per_sample_s=compute_per_sample, alpha_s=alpha,
                         beta_s_per_byte=beta, projection_batch=projection_batch,
                         projection=projection)


def plot_scaling(result: ScalingResult, path: str) -> None:
    """samples/s against workers per batch size (measured), and the projection (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for batch in sorted({p.global_batch_size for p in result.points}):
        pts = [p for p in result.points if p.global_batch_size == batch]
        left.plot([p.workers for p in pts], [p.samples_per_s for p in pts], "o-", label=f"B={batch}")
        right.plot([p.workers for p in pts], [p.efficiency for p in pts], "o-", label=f"B={batch}")
    proj = result.projection
    left.plot([p.workers for p in proj], [p.samples_per_s for p in proj], "k--",
              label=f"projection B={result.projection_batch}")
    right.plot([p.workers for p in proj], [p.efficiency for p in proj], "k--", label="projection")
    for ax, label in ((left, "samples/s"), (right, "scaling efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_yscale("log")
    fig.suptitle(f"{result.model}: {result.parameters:,} parameters, measured (solid) and "
                 "projected (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
