"""`elastic bench gpu`: training throughput on one GPU, `elastic.fit` against a plain PyTorch
loop on the same GPU with the same model, data, batch and settings (bf16 autocast, channels-last
images for the CNN, pinned batches read by two loader processes).

Models: ResNet-50 on 224 px images (images/s; torchvision) and GPT-2 124M on 1024-token
sequences (tokens/s; transformers). The data are synthetic and cycle over a small distinct set,
so building them costs nothing beside the step. Throughput is measured over the steps after a
warm-up, from the end of the last warm-up step to the end of the last step: the plain loop's
with `torch.cuda.synchronize()`, `elastic.fit`'s from its metrics lines (each step's end on the
last rank to end it). Needs CUDA; `elastic.fit` runs with `scaling.use_gpu` and backend 'nccl'
(world size 1: no NCCL call) or, with several workers sharing the GPU, backend 'shm'.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

MODELS = ("resnet50", "gpt2")
# model -> (global batch, samples per item unit for the rate, warm-up steps, measured steps)
SIZES = {"resnet50": (128, 1, 8, 30), "gpt2": (8, 1024, 5, 20)}
IMAGE, CLASSES, DISTINCT = 224, 1000, 256
VOCAB, SEQ = 50257, 1024


class Cycled(Dataset):
    """`length` samples cycling over `DISTINCT` seeded ones (uint8 images or token ids)."""

    def __init__(self, model: str, length: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.model, self.length = model, length
        if model == "resnet50":
            self.x = torch.randint(0, 256, (DISTINCT, 3, IMAGE, IMAGE), dtype=torch.uint8, generator=g)
            self.y = torch.randint(0, CLASSES, (DISTINCT,), generator=g)
        else:
            self.x = torch.randint(0, VOCAB, (DISTINCT, SEQ), generator=g)
            self.y = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        j = i % DISTINCT
        return (self.x[j], self.y[j]) if self.y is not None else self.x[j]


def make_model(model: str) -> nn.Module:
    torch.backends.cudnn.benchmark = True
    if model == "resnet50":
        import torchvision

        return torchvision.models.resnet50(num_classes=CLASSES).to(memory_format=torch.channels_last)
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_positions=SEQ, n_embd=768, n_layer=12, n_head=12,
                                      vocab_size=VOCAB))


def make_optimizer(model: str, params: Any) -> torch.optim.Optimizer:
    if model == "resnet50":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)


def loss_of(model_name: str, model: nn.Module, batch: Any) -> torch.Tensor:
    if model_name == "resnet50":
        x, y = batch
        x = x.float().div_(255).contiguous(memory_format=torch.channels_last)
        return nn.functional.cross_entropy(model(x), y)
    return model(input_ids=batch, labels=batch).loss


@dataclass
class Throughput:
    model: str
    runner: str  # "plain" or "elastic-N" (N workers on the GPU)
    batch: int
    steps: int
    per_s: float  # images/s or tokens/s
    step_s: float  # wall seconds per step
    peak_memory_gb: float | None
    # elastic only: medians of the in-step phases and the mean idle gap (seconds), from
    # `elastic.bench.overhead.breakdown`
    phases: dict[str, float | None] | None = None


def plain(model_name: str, device: torch.device) -> Throughput:
    """The plain loop: DataLoader with 2 workers and pinned memory, bf16 autocast."""
    batch, unit, warmup, steps = SIZES[model_name]
    torch.manual_seed(0)
    model = make_model(model_name).to(device)
    optimizer = make_optimizer(model_name, model.parameters())
    loader = DataLoader(Cycled(model_name, batch * (warmup + steps)), batch_size=batch,
                        num_workers=2, pin_memory=True)
    torch.cuda.reset_peak_memory_stats(device)
    start = None
    for i, b in enumerate(loader):
        if i == warmup:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
        b = [t.to(device, non_blocking=True) for t in b] if isinstance(b, list) else b.to(
            device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model_name, model, b)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 1e9
    del model, optimizer
    torch.cuda.empty_cache()
    return Throughput(model_name, "plain", batch, steps, batch * unit * steps / seconds,
                      seconds / steps, peak)


class _Loss:
    def __init__(self, model: str) -> None:
        self.model = model

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return loss_of(self.model, model, batch)


class _Factory:
    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __call__(self, *more: Any) -> Any:
        return self.fn(*self.args, *more)


def elastic_run(model_name: str, workers: int = 1, backend: str = "nccl",
                gpus_per_worker: float | None = None) -> Throughput:
    """`elastic.fit` on the GPU with `workers` workers (more than one share it)."""
    from elastic.api import fit
    from elastic.bench.overhead import breakdown, elastic_rows
    from elastic.config import (
        BatchConfig,
        CollectiveConfig,
        DataConfig,
        FitConfig,
        LoggingConfig,
        ScalingConfig,
        TrainingConfig,
    )
    from elastic.job import TrainJob

    batch, unit, warmup, steps = SIZES[model_name]
    job = TrainJob(model=_Factory(make_model, model_name),
                   optimizer=_Factory(make_optimizer, model_name), loss=_Loss(model_name),
                   dataset=_Factory(Cycled, model_name, batch * (warmup + steps)))
    scaling: dict[str, Any] = {"num_workers": workers, "use_gpu": True, "cpus_per_worker": 2,
                               "threads_per_worker": 2}
    if gpus_per_worker is not None:
        scaling["gpus_per_worker"] = gpus_per_worker
    config = FitConfig(
        scaling=ScalingConfig(**scaling),
        collective=CollectiveConfig(backend=backend),
        batch=BatchConfig(global_batch_size=batch, max_micro_batch=batch, autotune=False),
        data=DataConfig(loader_workers=2, pin_memory=True),
        training=TrainingConfig(precision="bf16-mixed"),
        logging=LoggingConfig(progress="off"),
        max_steps=warmup + steps,
        run_dir=tempfile.mkdtemp(prefix=f"bench-gpu-{model_name}-"),
    )
    result = fit(job, config)
    rows = elastic_rows(result.metrics)
    seconds = rows[-1]["time"] - rows[warmup - 1]["time"]
    phases = asdict(breakdown(rows, warmup))
    return Throughput(model_name, f"elastic-{workers}", batch, steps,
                      batch * unit * steps / seconds, seconds / steps, None, phases)


def run(out_dir: str, models: tuple[str, ...] = MODELS, shared_workers: int = 4) -> list[Throughput]:
    """Every model, plain then elastic (1 worker, then `shared_workers` sharing the GPU if
    above 0); writes gpu_throughput.json in `out_dir` after each measurement."""
    device = torch.device("cuda", 0)
    results: list[Throughput] = []
    path = os.path.join(out_dir, "gpu_throughput.json")

    def keep(result: Throughput) -> None:
        results.append(result)
        print(json.dumps(asdict(result)), flush=True)
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device),
                       "torch": torch.__version__, "results": [asdict(r) for r in results]}, f,
                      indent=1)

    for model_name in models:
        keep(plain(model_name, device))
        keep(elastic_run(model_name))
        if shared_workers:
            keep(elastic_run(model_name, shared_workers, backend="gloo",
                             gpus_per_worker=1 / shared_workers))
    return results


def table(path: str) -> None:
    """Prints the results in `path` (gpu_throughput.json) as a table, each elastic row beside
    its model's plain loop."""
    from rich.console import Console
    from rich.table import Table

    with open(path) as f:
        data = json.load(f)
    plain_rate = {r["model"]: r["per_s"] for r in data["results"] if r["runner"] == "plain"}
    out = Table(title=f"{data['device']}, torch {data['torch']}: bf16 autocast, 2 loader processes")
    for column in ("model", "runner", "batch", "rate /s", "ms / step", "vs plain"):
        out.add_column(column, justify="right")
    for r in data["results"]:
        unit = "img" if r["model"] == "resnet50" else "tok"
        base = plain_rate.get(r["model"])
        out.add_row(r["model"], r["runner"], str(r["batch"]), f"{r['per_s']:,.0f} {unit}",
                    f"{r['step_s'] * 1e3:.1f}", f"{r['per_s'] / base:.2f}x" if base else "-")
    Console().print(out)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--table"]:
        table(sys.argv[2])
    else:
        run(sys.argv[1] if len(sys.argv) > 1 else ".",
            tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else MODELS)
