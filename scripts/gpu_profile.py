"""Where a GPU step of elastic's replica spends its time beside a plain PyTorch step: ResNet-50
(bf16 autocast, channels-last, batch 128) in one process, no Ray and no loader processes, the
batch already in pinned host memory for both. Writes to the folder argv[1]: profile.txt (the
timings, the profiler's top operations, and every place a step waits for the device, from
torch's sync debug mode), for the replica alone (a generation of one rank) and summing
through buckets as a rank of several would."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

import torch

from elastic.bench.gpu import SIZES, Cycled, loss_of, make_model, make_optimizer

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
B, STEPS, WARMUP = 128, 15, 5
SIZE = SIZES["full"]["resnet50"]
log = open(os.path.join(OUT, "profile.txt"), "w")


def say(*parts: object) -> None:
    print(*parts, file=log, flush=True)
    print(*parts, flush=True)


def plain(batch) -> float:
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = make_model("resnet50", SIZE).to(device)
    opt = make_optimizer("resnet50", model.parameters())
    for i in range(WARMUP + STEPS):
        if i == WARMUP:
            torch.cuda.synchronize()
            start = time.perf_counter()
        b = [t.to(device, non_blocking=True) for t in batch]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of("resnet50", model, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # one read of the loss per step, as a training loop that logs it
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / STEPS


def replica(alone: bool = True):
    from elastic import BatchConfig, FitConfig, ScalingConfig, TrainJob
    from elastic.bench.gpu import _Factory, _Loss
    from elastic.config import CollectiveConfig, TrainingConfig
    from elastic.trainer.replica import Replica
    from elastic.trainer.step import BatchPlan
    from tests.gpu.planes import PlaneCheck

    job = TrainJob(model=_Factory(make_model, "resnet50", SIZE),
                   optimizer=_Factory(make_optimizer, "resnet50"), loss=_Loss("resnet50"),
                   dataset=_Factory(Cycled, "resnet50", SIZE, B * 1000))
    config = FitConfig(scaling=ScalingConfig(num_workers=1, use_gpu=True),
                       collective=CollectiveConfig(backend="nccl", overlap=True),
                       batch=BatchConfig(global_batch_size=B, max_micro_batch=B, autotune=False,
                                         rebalance=False),
                       training=TrainingConfig(precision="bf16-mixed"),
                       run_dir=tempfile.mkdtemp(), max_steps=10_000)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    r = Replica(job, config, config.run_dir, device)
    if not alone:  # the reducer a rank of several runs (buckets or flat), at one rank
        r._solo = None
    r.comm = PlaneCheck()
    plan = BatchPlan(B, (B,), (B,))
    return r, plan


def timed(r, plan) -> float:
    for i in range(WARMUP + STEPS):
        if i == WARMUP:
            torch.cuda.synchronize()
            start = time.perf_counter()
        r.run_step(plan, [])
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / STEPS


def main() -> None:
    data = Cycled("resnet50", SIZE, B)
    batch = [torch.stack([data[i][0] for i in range(B)]).pin_memory(),
             torch.stack([data[i][1] for i in range(B)]).pin_memory()]
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

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    r.run_step(plan, [])
                torch.cuda.synchronize()
            say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                r.run_step(plan, [])
                torch.cuda.set_sync_debug_mode(0)
            sites: dict[str, int] = {}
            for w in caught:
                where = f"{w.filename}:{w.lineno} {str(w.message)[:60]}"
                sites[where] = sites.get(where, 0) + 1
            say(f"synchronising calls in one step: {len(caught)}")
            for message, n in sorted(sites.items(), key=lambda kv: -kv[1]):
                say(f"  {n} x {message}")
        r.close()
        del r
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
