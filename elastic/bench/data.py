"""`elastic bench data`: training that waits on decoding, with and without loader processes,
against the bound and a plain DDP loop with `DataLoader(num_workers=k)`.

The data set holds PNG-encoded images (made once, synthetic: gradients and noise, so that the
codec has real work); reading a sample decodes it with Pillow, takes a random crop and flip
(torch's generator, seeded per group by the step) and normalises it. Its cost is set by the
image size. Measured in this process, on one thread: the time to read one rank's share of a
step (data) and the time of its forward/backward and optimizer step on decoded tensors
(compute). The bound for a rank with k loader processes is max(compute, data / k); without
them a step costs compute + data. Then `elastic.fit` with 0 and with k loader processes, and
DDP (gloo, one process per rank) whose `DataLoader` yields each rank's share of the same public
order, with `num_workers=0` (read in the training process) and with `num_workers=k,
prefetch_factor=2, persistent_workers=True`, all with the same model, global batch and world
size: elastic and DDP each without and with loader processes. With `rounds` > 1 the four runs
alternate, in an order rotated every round so that none always runs first (on a machine with
few cores one run's leftovers slow the next). Reported: median step time (elastic: from each
step's start to its end, waiting for data included; DDP: from one step's end to the next's)
and wall-clock per step.
"""

from __future__ import annotations

import io
import itertools
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from elastic.api import fit
from elastic.bench import classification_loss, leave_ddp, run_ddp, sgd
from elastic.config import BatchConfig, DataConfig, FitConfig, ScalingConfig
from elastic.job import TrainJob

CROP = 8  # pixels cut from each side's total by the random crop


class EncodedImages(Dataset):
    """`n` PNG images of `size` x `size` pixels, 10 classes; a read decodes and augments."""

    def __init__(self, n: int, size: int, seed: int = 0) -> None:
        from PIL import Image

        rng = np.random.default_rng(seed)
        self.labels = rng.integers(0, 10, n).tolist()
        ramp = np.linspace(0, 255, size, dtype=np.float32)
        self.images = []
        for label in self.labels:
            base = (ramp[None, :, None] * (label + 1) / 10 + ramp[:, None, None] / 2) % 256
            pixels = np.clip(base + rng.normal(0, 24, (size, size, 3)), 0, 255).astype(np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format="PNG")
            self.images.append(out.getvalue())
        self.size = size

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        pixels = np.asarray(Image.open(io.BytesIO(self.images[i])).convert("RGB"))
        x = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div_(255)
        crop = self.size - CROP
        top, left = (int(v) for v in torch.randint(0, CROP + 1, (2,)))
        x = x[:, top : top + crop, left : left + crop]
        if float(torch.rand(())) < 0.5:
            x = x.flip(2)
        return (x - 0.5) / 0.25, self.labels[i]


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(32 * 16, 10),
    )


def _dataset(samples: int, size: int) -> EncodedImages:
    return EncodedImages(samples, size)


@dataclass
class DataBenchResult:
    workers: int
    loader_workers: int
    global_batch_size: int
    image_size: int
    steps: int
    warmup: int
    data_s: float  # one rank's share, read on one thread
    compute_s: float  # one rank's forward/backward and optimizer step on decoded tensors
    bound_s: float  # max(compute, data / loader_workers)
    serial_s: float  # compute + data
    no_loaders_step_s: float
    loaders_step_s: float
    ddp_step_s: float  # DDP with DataLoader(num_workers=loader_workers)
    no_loaders_wall_s: float
    loaders_wall_s: float
    ddp_wall_s: float
    ddp_no_loaders_step_s: float  # DDP with DataLoader(num_workers=0)
    ddp_no_loaders_wall_s: float
    rounds: list[dict] = field(default_factory=list)

    @property
    def bound_ratio(self) -> float:
        return self.loaders_step_s / self.bound_s

    @property
    def ddp_ratio(self) -> float:
        """elastic with loader processes against DDP with as many `DataLoader` workers."""
        return self.loaders_step_s / self.ddp_step_s

    @property
    def ddp_no_loaders_ratio(self) -> float:
        """elastic against DDP, both reading in the training process."""
        return self.no_loaders_step_s / self.ddp_no_loaders_step_s

    def rows(self) -> list[tuple[str, float, float]]:
        """(run, median step s, wall s per step): elastic and DDP, without then with loader
        processes, for a table."""
        k = self.loader_workers
        return [("elastic.fit, no loader processes", self.no_loaders_step_s, self.no_loaders_wall_s),
                ("torch DDP, DataLoader(num_workers=0)", self.ddp_no_loaders_step_s,
                 self.ddp_no_loaders_wall_s),
                (f"elastic.fit, loader_workers={k}", self.loaders_step_s, self.loaders_wall_s),
                (f"torch DDP, DataLoader(num_workers={k})", self.ddp_step_s, self.ddp_wall_s)]

    def to_json(self) -> dict:
        return {**asdict(self), "bound_ratio": self.bound_ratio, "ddp_ratio": self.ddp_ratio,
                "ddp_no_loaders_ratio": self.ddp_no_loaders_ratio}


def _measure_parts(samples: int, size: int, share: int, repeats: int = 5) -> tuple[float, float]:
    """(data, compute) seconds of one rank's share, medians, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = _dataset(samples, size)
        model = make_model()
        optimizer = sgd(model.parameters(), momentum=0.9)
        reads, computes = [], []
        for r in range(repeats):
            started = time.perf_counter()
            batch = torch.utils.data.default_collate([data[(r * share + i) % samples]
                                                      for i in range(share)])
            reads.append(time.perf_counter() - started)
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            classification_loss(model, batch).backward()
            optimizer.step()
            computes.append(time.perf_counter() - started)
        return statistics.median(reads[1:]), statistics.median(computes[1:])
    finally:
        torch.set_num_threads(threads)


class _ShareSampler:
    """Each step's share of `rank` in the public order (even shares), as a batch sampler."""

    def __init__(self, samples: int, batch: int, rank: int, world: int, steps: int) -> None:
        self.samples, self.batch, self.rank, self.world, self.steps = samples, batch, rank, world, steps

    def __iter__(self):
        share, per_epoch = self.batch // self.world, self.samples // self.batch
        for step in range(self.steps):
            epoch, s = divmod(step, per_epoch)
            perm = torch.randperm(self.samples, generator=torch.Generator().manual_seed(epoch))
            start = s * self.batch + self.rank * share
            yield perm[start : start + share].tolist()

    def __len__(self) -> int:
        return self.steps


def _ddp_worker(rank: int, world: int, store: str, samples: int, size: int, batch: int,
                steps: int, loaders: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = sgd(model.parameters(), momentum=0.9)
    loader = DataLoader(_dataset(samples, size),
                        batch_sampler=_ShareSampler(samples, batch, rank, world, steps),
                        num_workers=loaders, prefetch_factor=2 if loaders else None,
                        persistent_workers=loaders > 0,
                        multiprocessing_context="spawn" if loaders else None)
    ends = [time.perf_counter()]
    for batch_ in loader:
        optimizer.zero_grad(set_to_none=True)
        classification_loss(model, batch_).backward()
        optimizer.step()
        ends.append(time.perf_counter())
    times = [b - a for a, b in itertools.pairwise(ends)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (times, ends))
    if rank == 0:
        torch.save({"times": [max(t[0][i] for t in gathered) for i in range(steps)],
                    "ends": gathered[0][1]}, out)
    leave_ddp(out, rank)


def _elastic(samples: int, size: int, workers: int, batch: int, steps: int, loaders: int,
             warmup: int) -> tuple[float, float]:
    job = TrainJob(model=make_model, optimizer=lambda p: sgd(p, momentum=0.9),
                   loss=classification_loss, dataset=lambda: _dataset(samples, size))
    config = FitConfig(
        scaling=ScalingConfig(num_workers=workers),
        batch=BatchConfig(global_batch_size=batch, autotune=False, rebalance=False, groups="off"),
        max_steps=steps, steps_per_chunk=steps, data=DataConfig(loader_workers=loaders),
        run_dir=tempfile.mkdtemp(prefix="elastic-bench-data-"))
    measured = [m for m in fit(job, config).metrics if m["step"] >= warmup]
    wall = (measured[-1]["time"] - measured[0]["time"]) / (len(measured) - 1)
    return statistics.median(m["step_time_s"] for m in measured), wall


def _ddp(samples: int, size: int, workers: int, batch: int, steps: int, loaders: int,
         warmup: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "ddp.pt")
        run_ddp(_ddp_worker, (workers, os.path.join(directory, "store"), samples, size, batch,
                              steps, loaders, out), workers, out)
        ddp = torch.load(out, weights_only=True)
    ends = ddp["ends"][warmup + 1 :]
    return statistics.median(ddp["times"][warmup:]), (ends[-1] - ends[0]) / (len(ends) - 1)


def run_data_bench(workers: int = 2, loader_workers: int = 2, global_batch_size: int = 64,
                   image_size: int = 96, steps: int = 60, warmup: int | None = None,
                   rounds: int = 1, samples: int = 512) -> DataBenchResult:
    """See the module docstring; `rounds` runs of the four, alternating (medians reported);
    the first `warmup` steps of each (default a third: loader processes start and import
    torch then, competing for the cores) are left out.

    Raises:
        ValueError: sizes that do not fit.
    """
    warmup = steps // 3 if warmup is None else warmup
    if workers < 1 or loader_workers < 1 or rounds < 1:
        raise ValueError("--workers, --loader-workers and --rounds must be at least 1")
    if global_batch_size % workers or steps <= warmup + 2 or image_size <= CROP + 4:
        raise ValueError(f"need --batch divisible by --workers, more than {warmup + 2} steps "
                         f"and --image-size above {CROP + 4}")
    if samples < global_batch_size:
        raise ValueError("the data set must hold at least one global batch")
    data_s, compute_s = _measure_parts(samples, image_size, global_batch_size // workers)
    runs = {"no_loaders": (_elastic, 0), "loaders": (_elastic, loader_workers),
            "ddp_no_loaders": (_ddp, 0), "ddp": (_ddp, loader_workers)}
    names = list(runs)
    per_round = []
    for r in range(rounds):
        measured = {}
        for name in names[r % len(names):] + names[: r % len(names)]:
            run, loaders = runs[name]
            step, wall = run(samples, image_size, workers, global_batch_size, steps, loaders, warmup)
            measured |= {f"{name}_step_s": step, f"{name}_wall_s": wall}
        per_round.append(measured)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in per_round)

    return DataBenchResult(
        workers=workers, loader_workers=loader_workers, global_batch_size=global_batch_size,
        image_size=image_size, steps=steps, warmup=warmup, data_s=data_s, compute_s=compute_s,
        bound_s=max(compute_s, data_s / loader_workers), serial_s=compute_s + data_s,
        no_loaders_step_s=median("no_loaders_step_s"), loaders_step_s=median("loaders_step_s"),
        ddp_step_s=median("ddp_step_s"), no_loaders_wall_s=median("no_loaders_wall_s"),
        loaders_wall_s=median("loaders_wall_s"), ddp_wall_s=median("ddp_wall_s"),
        ddp_no_loaders_step_s=median("ddp_no_loaders_step_s"),
        ddp_no_loaders_wall_s=median("ddp_no_loaders_wall_s"), rounds=per_round)
