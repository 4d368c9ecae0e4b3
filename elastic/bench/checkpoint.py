"""`elastic bench checkpoint`: what an asynchronous checkpoint costs the training loop, against
a synchronous save of the same state, and write throughput against a plain fsynced write of
the same bytes to the same disk, in one run."""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from elastic.checkpoint import CheckpointWriter, write_checkpoint
from elastic.checkpoint.store import serialize


@dataclass(frozen=True)
class CheckpointBenchResult:
    state_bytes: int
    sync_save_s: float
    async_stall_s: float
    stall_fraction: float
    checkpoint_write_gbps: float
    plain_write_gbps: float
    write_fraction: float
    trials: int
    directory: str

    def to_json(self) -> dict:
        return asdict(self)


def _state(size_mb: int) -> dict:
    # Like a model plus an Adam optimizer: parameters and two moment buffers.
    n = size_mb * (1 << 20) // 4 // 3
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(n, generator=g)},
            "optimizer": {"exp_avg": torch.randn(n, generator=g), "exp_avg_sq": torch.rand(n, generator=g)}}


def _plain_write(path: str, data: bytes) -> float:
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def run_checkpoint_bench(size_mb: int = 256, trials: int = 3,
                         directory: str | None = None) -> CheckpointBenchResult:
    """Measures, `trials` times each (median): a synchronous save (serialise, write, fsync,
    commit), the stall of an asynchronous one (the snapshot copy on the training thread),
    and a plain fsynced write of the same bytes.

    Raises:
        ValueError: non-positive size or trials.
    """
    if size_mb < 1 or trials < 1:
        raise ValueError("--size-mb and --trials must be positive")
    root = directory or tempfile.mkdtemp(prefix="elastic-bench-ckpt-")
    state = _state(size_mb)
    total = sum(len(serialize(v)) for v in state.values())
    sync_times, stalls, commit_times, plain_times = [], [], [], []
    writer = CheckpointWriter(os.path.join(root, "async"), keep_last=1)
    for trial in range(trials):
        start = time.perf_counter()
        write_checkpoint(os.path.join(root, "sync"), trial, {k: serialize(v) for k, v in state.items()}, {})
        sync_times.append(time.perf_counter() - start)

        start = time.perf_counter()
        snapshot = {k: copy.deepcopy(v) for k, v in state.items()}
        writer.submit(trial, snapshot, {})
        stalls.append(time.perf_counter() - start)
        writer.flush()
        (report,) = writer.take_reports()
        commit_times.append(report.seconds)

        blob = b"".join(serialize(v) for v in state.values())
        plain_times.append(_plain_write(os.path.join(root, f"plain-{trial}.bin"), blob))
    sync_s = statistics.median(sync_times)
    stall_s = statistics.median(stalls)
    write_gbps = total / statistics.median(commit_times) / 1e9
    plain_gbps = total / statistics.median(plain_times) / 1e9
    return CheckpointBenchResult(
        state_bytes=total, sync_save_s=sync_s, async_stall_s=stall_s,
        stall_fraction=stall_s / sync_s, checkpoint_write_gbps=write_gbps,
        plain_write_gbps=plain_gbps, write_fraction=write_gbps / plain_gbps, trials=trials,
        directory=root,
    )
