"""`elastic bench overhead`: `elastic.fit` against a plain `DistributedDataParallel` loop on
gloo, same model, data, global batch and world size, in one invocation.

The DDP processes are spawned by the benchmark (torch.multiprocessing, a FileStore
rendezvous, one thread each like a Ray worker with one CPU). Both take the same samples per
step (the public order, even shares). Reported: the median in-step time (data loading to
optimizer step, measured inside each worker, the slowest rank per step) and the wall-clock
time per step over the measured steps (for `elastic.fit` this includes the controller's
round trip between chunks of steps).
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import TensorDataset

from elastic.api import fit
from elastic.bench import classification_loss, sgd
from elastic.config import BatchConfig, CollectiveConfig, FitConfig, ScalingConfig
from elastic.job import TrainJob

MODELS = ("mlp", "cnn")
SAMPLES = 8192


def make_dataset(model: str) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    shape = (SAMPLES, 784) if model == "mlp" else (SAMPLES, 3, 32, 32)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, 10, (SAMPLES,), generator=g)
    return TensorDataset(x, y)


def make_model(model: str) -> nn.Module:
    if model == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )



_optimizer = functools.partial(sgd, momentum=0.9)


@dataclass
class OverheadResult:
    model: str
    workers: int
    global_batch_size: int
    steps: int
    warmup: int
    parameters: int
    elastic_step_median_s: float
    ddp_step_median_s: float
    step_ratio: float
    elastic_wall_per_step_s: float
    ddp_wall_per_step_s: float
    wall_ratio: float
    elastic_comm_median_s: float
    elastic_forward_backward_median_s: float
    algorithm: str
    overlap: bool
    # One (elastic, DDP) pair per round, run alternately; the fields above are medians over
    # the rounds (the ratios: the median of the per-round ratios).
    rounds: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _ddp_worker(rank: int, world: int, store_path: str, model_name: str, batch: int, steps: int,
                out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_model(model_name))
    optimizer = _optimizer(model.parameters())
    data = make_dataset(model_name)
    x, y = data.tensors
    share = batch // world
    per_epoch = SAMPLES // batch
    times, ends = [], []
    perm = None
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        started = time.perf_counter()
        if s == 0:
            perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
        idx = perm[s * batch + rank * share : s * batch + (rank + 1) * share]
        xb, yb = x[idx], y[idx]
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
        ends.append(time.time())
    gathered: list = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:
        slowest = [max(t[i] for t in gathered) for i in range(steps)]
        torch.save({"times": slowest, "ends": ends}, out_path)
    # Both ranks leave together: a rank tearing its pairs down while the other is still
    # working made gloo abort the other process (SIGABRT, seen once in CI).
    dist.barrier()
    dist.destroy_process_group()


def run_overhead_bench(workers: int = 2, model: str = "mlp", steps: int = 40,
                       global_batch_size: int = 256, warmup: int = 8,
                       algorithm: str = CollectiveConfig().algorithm,
                       overlap: bool | None = None, rounds: int = 1) -> OverheadResult:
    """Trains `model` for `steps` steps with `elastic.fit` and with DDP, `rounds` times
    alternately (so that drift of the shared machine hits both alike); medians leave out the
    first `warmup` steps of each run.

    Raises:
        ValueError: an unknown model, or sizes that do not fit.
    """
    if model not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {model!r}")
    if workers < 1 or steps <= warmup + 2:
        raise ValueError(f"need at least 1 worker and more than {warmup + 2} steps")
    if global_batch_size % workers:
        raise ValueError("--batch must be divisible by --workers (DDP takes even shares)")
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {rounds}")
    job = TrainJob(model=lambda: make_model(model), optimizer=_optimizer, loss=classification_loss,
                   dataset=lambda: make_dataset(model))
    collective = CollectiveConfig(algorithm=algorithm, overlap=overlap)  # type: ignore[arg-type]
    per_round = []
    for _ in range(rounds):
        config = FitConfig(
            scaling=ScalingConfig(num_workers=workers),
            batch=BatchConfig(global_batch_size=global_batch_size, autotune=False, rebalance=False),
            collective=collective, max_steps=steps, steps_per_chunk=steps,
            run_dir=tempfile.mkdtemp(prefix="elastic-bench-overhead-"),
        )
        result = fit(job, config)
        measured = [m for m in result.metrics if m["step"] >= warmup]
        elastic_step = statistics.median(m["step_time_s"] for m in measured)
        with tempfile.TemporaryDirectory() as directory:
            store = os.path.join(directory, "store")
            out = os.path.join(directory, "ddp.pt")
            mp.start_processes(_ddp_worker,
                               args=(workers, store, model, global_batch_size, steps, out),
                               nprocs=workers, join=True, start_method="spawn")
            ddp = torch.load(out, weights_only=True)
        ddp_step = statistics.median(ddp["times"][warmup:])
        ends = ddp["ends"][warmup:]
        ddp_wall = (ends[-1] - ends[0]) / (len(ends) - 1)
        elastic_wall = (measured[-1]["time"] - measured[0]["time"]) / (len(measured) - 1)
        per_round.append({
            "elastic_step_median_s": elastic_step, "ddp_step_median_s": ddp_step,
            "step_ratio": elastic_step / ddp_step,
            "elastic_wall_per_step_s": elastic_wall, "ddp_wall_per_step_s": ddp_wall,
            "wall_ratio": elastic_wall / ddp_wall,
            "elastic_comm_median_s": statistics.median(m["comm_s"] for m in measured),
            "elastic_forward_backward_median_s":
                statistics.median(m["forward_backward_s"] for m in measured),
        })

    def median(key: str) -> float:
        return statistics.median(r[key] for r in per_round)

    parameters = sum(p.numel() for p in make_model(model).parameters())
    return OverheadResult(
        model=model, workers=workers, global_batch_size=global_batch_size, steps=steps,
        warmup=warmup, parameters=parameters,
        elastic_step_median_s=median("elastic_step_median_s"),
        ddp_step_median_s=median("ddp_step_median_s"), step_ratio=median("step_ratio"),
        elastic_wall_per_step_s=median("elastic_wall_per_step_s"),
        ddp_wall_per_step_s=median("ddp_wall_per_step_s"), wall_ratio=median("wall_ratio"),
        elastic_comm_median_s=median("elastic_comm_median_s"),
        elastic_forward_backward_median_s=median("elastic_forward_backward_median_s"),
        algorithm=algorithm, overlap=collective.overlap_enabled, rounds=per_round,
    )
