"""`elastic bench gpu`: training throughput on one GPU, `elastic.fit` against a plain PyTorch
loop on the same GPU with the same model, data, batch and settings (bf16 autocast, channels-last
images for the CNN, pinned batches read by two loader processes).

Models: ResNet-50 on 224 px images (images/s; torchvision) and GPT-2 124M on 1024-token
sequences (tokens/s; transformers). The data are synthetic and cycle over a small distinct set,
so building them costs nothing beside the step. Throughput is measured over the steps after a
warm-up, from the end of the last warm-up step to the end of the last step: the plain loop's
with `torch.cuda.synchronize()`, `elastic.fit`'s from its metrics lines (each step's end on the
last rank to end it). On CUDA `elastic.fit` runs with `scaling.use_gpu` and backend 'nccl'
(world size 1: no NCCL call) or, with several workers sharing the GPU, backend 'gloo' (the
host-staged plane).

`size="tiny"` with `device="cpu"` is the rehearsal: the same code at a size a CPU runs in
seconds (`make test` runs it; `make gpu-check` with `GPU_CHECK_DEVICE=cpu` too), so that a GPU
machine's few minutes are not spent on finding a mistake in the bench itself.
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
CLASSES, DISTINCT = 1000, 256


@dataclass(frozen=True)
class Size:
    """One model's run: global batch, warm-up and measured steps, and the model's shape
    (image side for the CNN; sequence, layers, width and vocabulary for GPT-2)."""

    batch: int
    warmup: int
    steps: int
    image: int = 224
    seq: int = 1024
    layers: int = 12
    width: int = 768
    vocab: int = 50257
    threads: int = 2  # CPU threads of each elastic worker (and its Ray CPUs)

    def unit(self, model: str) -> int:
        """Items per sample: one image, or `seq` tokens."""
        return 1 if model == "resnet50" else self.seq


SIZES = {
    "full": {"resnet50": Size(128, 8, 30), "gpt2": Size(8, 5, 20)},
    # ResNet-50 at 64 px: 2x2 maps in its last stage, so 1 image per worker still gives its
    # BatchNorm layers several values per channel.
    "tiny": {"resnet50": Size(8, 2, 3, image=64, threads=1),
             "gpt2": Size(8, 2, 3, seq=32, layers=2, width=64, vocab=512, threads=1)},
}


class Cycled(Dataset):
    """`length` samples cycling over `DISTINCT` seeded ones (uint8 images or token ids)."""

    def __init__(self, model: str, size: Size, length: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.model, self.length = model, length
        if model == "resnet50":
            self.x = torch.randint(0, 256, (DISTINCT, 3, size.image, size.image), dtype=torch.uint8,
                                   generator=g)
            self.y = torch.randint(0, CLASSES, (DISTINCT,), generator=g)
        else:
            self.x = torch.randint(0, size.vocab, (DISTINCT, size.seq), generator=g)
            self.y = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        j = i % DISTINCT
        return (self.x[j], self.y[j]) if self.y is not None else self.x[j]


def make_model(model: str, size: Size) -> nn.Module:
    torch.backends.cudnn.benchmark = True
    if model == "resnet50":
        import torchvision

        return torchvision.models.resnet50(num_classes=CLASSES).to(memory_format=torch.channels_last)
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_positions=size.seq, n_embd=size.width, n_layer=size.layers,
                                      n_head=12 if size.width % 12 == 0 else 4,
                                      vocab_size=size.vocab, bos_token_id=size.vocab - 1,
                                      eos_token_id=size.vocab - 1))


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


def missing(model: str) -> str | None:
    """Why `model` cannot be built here (the library it needs), or None."""
    import importlib.util

    library = "torchvision" if model == "resnet50" else "transformers"
    return None if importlib.util.find_spec(library) else f"{model} needs {library}, not installed"


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain(model_name: str, device: torch.device, size: Size) -> Throughput:
    """The plain loop: DataLoader with 2 workers (pinned memory on a GPU), bf16 autocast."""
    torch.manual_seed(0)
    model = make_model(model_name, size).to(device)
    optimizer = make_optimizer(model_name, model.parameters())
    loader = DataLoader(Cycled(model_name, size, size.batch * (size.warmup + size.steps)),
                        batch_size=size.batch, num_workers=2, pin_memory=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = seconds = None
    for i, b in enumerate(loader):
        if i == size.warmup:
            _sync(device)
            start = time.perf_counter()
        b = [t.to(device, non_blocking=True) for t in b] if isinstance(b, list) else b.to(
            device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model_name, model, b)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i == size.warmup + size.steps - 1 and start is not None:
            # Stopped here: the loader's shutdown after its last batch (joining its processes)
            # is no step's, and elastic's figure ends at its last step too.
            _sync(device)
            seconds = time.perf_counter() - start
    assert seconds is not None, "the loader gave fewer batches than the steps measured"
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Throughput(model_name, "plain", size.batch, size.steps,
                      size.batch * size.unit(model_name) * size.steps / seconds,
                      seconds / size.steps, peak)


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


def elastic_run(model_name: str, device: torch.device, size: Size, workers: int = 1) -> Throughput:
    """`elastic.fit` with `workers` workers: on CUDA each with the GPU to itself (1, backend
    'nccl') or sharing it (several, `gpus_per_worker` 1/workers, backend 'gloo'); on the CPU
    (the rehearsal) CPU workers, backend 'gloo'."""
    from elastic.api import fit
    from elastic.bench.overhead import breakdown, chunk_starts, elastic_rows, run_metrics
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

    gpu = device.type == "cuda"
    job = TrainJob(model=_Factory(make_model, model_name, size),
                   optimizer=_Factory(make_optimizer, model_name), loss=_Loss(model_name),
                   dataset=_Factory(Cycled, model_name, size,
                                    size.batch * (size.warmup + size.steps)))
    scaling: dict[str, Any] = {"num_workers": workers, "use_gpu": gpu,
                               "cpus_per_worker": size.threads, "threads_per_worker": size.threads}
    if gpu and workers > 1:
        scaling["gpus_per_worker"] = 1 / workers
    backend = "nccl" if gpu and workers == 1 else "gloo"
    config = FitConfig(
        scaling=ScalingConfig(**scaling),
        collective=CollectiveConfig(backend=backend),
        batch=BatchConfig(global_batch_size=size.batch, max_micro_batch=size.batch, autotune=False),
        data=DataConfig(loader_workers=2, pin_memory=gpu),
        training=TrainingConfig(precision="bf16-mixed"),
        logging=LoggingConfig(progress="off"),
        max_steps=size.warmup + size.steps,
        run_dir=tempfile.mkdtemp(prefix=f"bench-gpu-{model_name}-"),
    )
    result = fit(job, config)
    rows = elastic_rows(run_metrics(result))
    assert len(rows) == size.warmup + size.steps, f"{len(rows)} metrics lines"
    sizes = sorted({r.get("world_size") for r in rows})
    if sizes != [workers]:  # the run starts with the workers the cluster can place
        raise ValueError(f"the elastic-{workers} row trained with {sizes} workers: the cluster "
                         f"has too few CPUs for {workers} workers of {size.threads} threads")
    seconds = rows[-1]["time"] - rows[size.warmup - 1]["time"]
    total = size.warmup + size.steps  # one epoch: the data set holds these steps' batches
    phases = asdict(breakdown(rows, size.warmup,
                              chunk_starts(total, config.steps_per_chunk, total)))
    return Throughput(model_name, f"elastic-{workers}", size.batch, size.steps,
                      size.batch * size.unit(model_name) * size.steps / seconds,
                      seconds / size.steps, None, phases)


def run(out_dir: str, models: tuple[str, ...] = MODELS, shared_workers: int = 4,
        device: str = "cuda", size: str = "full") -> list[Throughput]:
    """Every model, plain then elastic (1 worker, then `shared_workers` sharing the GPU if
    above 0); writes gpu_throughput.json in `out_dir` after each measurement."""
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    results: list[Throughput] = []
    path = os.path.join(out_dir, "gpu_throughput.json")
    name = torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu"

    def keep(result: Throughput) -> None:
        results.append(result)
        print(json.dumps(asdict(result)), flush=True)
        with open(path, "w") as f:
            json.dump({"device": name, "size": size, "torch": torch.__version__,
                       "results": [asdict(r) for r in results]}, f, indent=1)

    if shared_workers:  # a local cluster started now has CPUs for the widest run
        from elastic import BatchConfig, FitConfig, ScalingConfig, connect

        threads = max(SIZES[size][m].threads for m in models)
        connect(FitConfig(scaling=ScalingConfig(num_workers=shared_workers,
                                                cpus_per_worker=threads),
                          batch=BatchConfig(global_batch_size=shared_workers), max_steps=1))
    for model_name in models:
        chosen = SIZES[size][model_name]
        keep(plain(model_name, where, chosen))
        keep(elastic_run(model_name, where, chosen))
        if shared_workers:
            keep(elastic_run(model_name, where, chosen, shared_workers))
    return results


def table(path: str) -> None:
    """Prints the results in `path` (gpu_throughput.json) as a table, each elastic row beside
    its model's plain loop."""
    from rich.console import Console
    from rich.table import Table

    with open(path) as f:
        data = json.load(f)
    plain_rate = {r["model"]: r["per_s"] for r in data["results"] if r["runner"] == "plain"}
    size = data.get("size", "full")
    out = Table(title=f"{data['device']}, torch {data['torch']}: bf16 autocast, 2 loader processes"
                      + ("" if size == "full" else f" ({size} size: a rehearsal, not a measurement)"))
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
