"""Where a GPU step of elastic's replica spends its time beside a plain PyTorch step: ResNet-50
(bf16 autocast, channels-last, batch 128) in one process, no Ray and no loader processes. The
plain step copies one batch, collated once, from pinned host memory each step; the replica
reads and collates its batch from the data set each step and copies it unpinned (its `data`
phase in the timeline: subtract it for the step's own cost). Writes to the folder argv[1]: profile.txt (the
timings, the profiler's top operations, and every place a step waits for the device, from
torch's sync debug mode), for the replica alone (a generation of one rank) and summing
through buckets as a rank of several would.

Usage: gpu_profile.py OUT [MODEL [DEVICE SIZE]]: MODEL resnet50 (the default) or gpt2; DEVICE
SIZE cuda full (the default), or cpu tiny: the rehearsal (`GPU_CHECK_DEVICE=cpu
GPU_CHECK_PROFILE=1`), the same code on the CPU, where no wait for a device is counted."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

import torch

from elastic.bench.gpu import SIZES, Cycled, loss_of, make_model, make_optimizer

_ARGS = sys.argv[1:] + ["."] * (len(sys.argv) < 2)
OUT, MODEL, _DEVICE, _SIZE = (_ARGS + ["resnet50", "cuda", "full"][len(_ARGS) - 1 :])[:4]
if len(_ARGS) > 4 or MODEL not in SIZES["full"] or _DEVICE not in ("cuda", "cpu") \
        or _SIZE not in SIZES or (_DEVICE == "cpu") != (_SIZE == "tiny"):
    sys.exit("usage: gpu_profile.py OUT [resnet50|gpt2 [cuda full|cpu tiny]]")
DEVICE = torch.device("cuda", 0) if _DEVICE == "cuda" else torch.device("cpu")
SIZE = SIZES[_SIZE][MODEL]
B = SIZE.batch
STEPS, WARMUP = (15, 5) if DEVICE.type == "cuda" else (3, 2)
CUDA = DEVICE.type == "cuda"
log = open(os.path.join(OUT, "profile.txt"), "w")


def say(*parts: object) -> None:
    print(*parts, file=log, flush=True)
    print(*parts, flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def moved(batch):
    return ([t.to(DEVICE, non_blocking=True) for t in batch] if isinstance(batch, list)
            else batch.to(DEVICE, non_blocking=True))


def plain(batch) -> float:
    torch.manual_seed(0)
    model = make_model(MODEL, SIZE).to(DEVICE)
    opt = make_optimizer(MODEL, model.parameters())
    for i in range(WARMUP + STEPS):
        if i == WARMUP:
            sync()
            start = time.perf_counter()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = loss_of(MODEL, model, moved(batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # one read of the loss per step, as a training loop that logs it
    sync()
    return (time.perf_counter() - start) / STEPS


def replica(alone: bool = True):
    from elastic import BatchConfig, FitConfig, ScalingConfig, TrainJob
    from elastic.bench.gpu import _Factory, _Loss
    from elastic.config import CollectiveConfig, TrainingConfig
    from elastic.trainer.replica import Replica
    from elastic.trainer.step import BatchPlan
    from tests.gpu.planes import PlaneCheck

    job = TrainJob(model=_Factory(make_model, MODEL, SIZE),
                   optimizer=_Factory(make_optimizer, MODEL), loss=_Loss(MODEL),
                   dataset=_Factory(Cycled, MODEL, SIZE, B * 1000))
    config = FitConfig(scaling=ScalingConfig(num_workers=1, use_gpu=CUDA),
                       collective=CollectiveConfig(backend="nccl" if CUDA else "gloo", overlap=True),
                       batch=BatchConfig(global_batch_size=B, max_micro_batch=B, autotune=False,
                                         rebalance=False),
                       training=TrainingConfig(precision="bf16-mixed"),
                       run_dir=tempfile.mkdtemp(), max_steps=10_000)
    if CUDA:
        torch.cuda.set_device(DEVICE)
    r = Replica(job, config, config.run_dir, DEVICE)
    if not alone:  # the reducer a rank of several runs (buckets or flat), at one rank
        r._solo = None
    r.comm = PlaneCheck(cuda=CUDA)
    plan = BatchPlan(B, (B,), (B,))
    return r, plan


def timed(r, plan) -> float:
    for i in range(WARMUP + STEPS):
        if i == WARMUP:
            sync()
            start = time.perf_counter()
        r.run_step(plan, [])
    sync()
    return (time.perf_counter() - start) / STEPS


def main() -> None:
    from torch.utils.data import default_collate

    data = Cycled(MODEL, SIZE, B)
    batch = default_collate([data[i] for i in range(B)])
    if CUDA:
        batch = [t.pin_memory() for t in batch] if isinstance(batch, list) else batch.pin_memory()
    say(f"plain: {plain(batch) * 1e3:.1f} ms/step")
    for alone in (True, False):
        r, plan = replica(alone)
        say(f"replica {'alone (one rank)' if alone else 'buckets at one rank'}: "
            f"{timed(r, plan) * 1e3:.1f} ms/step")
        records = [r.run_step(plan, []) for _ in range(3)]
        say("  timeline of the last step (start, data, fwd/bwd, comm, optimizer):",
            [round(x, 4) for x in getattr(records[-1], "timeline", [])])
        if alone:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
            with profile(activities=activities) as prof:
                for _ in range(3):
                    r.run_step(plan, [])
                sync()
            say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if CUDA:  # on the CPU nothing waits for a device: none are counted
                    torch.cuda.set_sync_debug_mode("warn")
                r.run_step(plan, [])
                if CUDA:
                    torch.cuda.set_sync_debug_mode(0)
                caught = [w for w in caught if "synchroniz" in str(w.message)]
            sites: dict[str, int] = {}
            for w in caught:
                where = f"{w.filename}:{w.lineno} {str(w.message)[:60]}"
                sites[where] = sites.get(where, 0) + 1
            say(f"synchronising calls in one step: {len(caught)}")
            for message, n in sorted(sites.items(), key=lambda kv: -kv[1]):
                say(f"  {n} x {message}")
        r.close()
        del r
        if CUDA:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
