"""`elastic report`: PNG plots of a run from its events.jsonl and metrics.jsonl."""

from __future__ import annotations

import io
import json
import os
from typing import Any

from elastic.errors import ConfigError
from elastic.private import write_private
from elastic.runlog import read_jsonl

STAGES = (("detect_s", "detect"), ("abort_s", "abort"), ("rebuild_s", "rebuild"),
          ("restore_s", "restore"), ("first_step_s", "first step"))


def write_report(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Writes `training.png` (loss, throughput and world size over steps, failures and
    resizes marked) and, if the run recovered from failures, `recoveries.png` (each
    recovery's breakdown). Returns the paths written.

    Raises:
        ConfigError: `run_dir` has no metrics.jsonl.
    """
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    if not metrics:
        raise ConfigError(f"{run_dir} has no metrics.jsonl; is it a run directory?")
    out = out_dir or run_dir
    os.makedirs(out, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    written = []
    steps = [m["step"] for m in metrics]
    failures = [e["step"] for e in events if e["event"] == "worker_failure"]
    resizes = [e["step"] for e in events if e["event"] == "generation" and e.get("reason") == "resize"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    series = (("loss", "loss"), ("samples_per_s", "samples/s"), ("world_size", "workers"))
    for ax, (key, label) in zip(axes, series, strict=True):
        ax.plot(steps, [m.get(key) for m in metrics], linewidth=1)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        for i, step in enumerate(failures):
            ax.axvline(step, color="red", linestyle="--", linewidth=1,
                       label="worker lost" if i == 0 else None)
        for i, step in enumerate(resizes):
            ax.axvline(step, color="green", linestyle=":", linewidth=1,
                       label="resize / join" if i == 0 else None)
    axes[0].set_yscale("log")
    axes[2].yaxis.set_major_locator(MaxNLocator(integer=True))
    if failures or resizes:
        axes[0].legend(loc="upper right")
    axes[-1].set_xlabel("step")
    fig.suptitle(f"run {os.path.basename(os.path.normpath(run_dir))}")
    fig.tight_layout()
    path = os.path.join(out, "training.png")
    _save_figure(fig, path)
    plt.close(fig)
    written.append(path)

    recoveries = [e for e in events if e["event"] == "recovered"]
    if recoveries:
        fig, ax = plt.subplots(figsize=(max(5, 1 + 0.8 * len(recoveries)), 4.5))
        labels = [f"step {r['step']}\n{r['world_before']}->{r['world_after']}" for r in recoveries]
        bottom = [0.0] * len(recoveries)
        for key, name in STAGES:
            values = [1e3 * (r.get(key) or 0.0) for r in recoveries]
            ax.bar(labels, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_ylabel("ms")
        ax.set_title("recovery breakdown (kill to first completed step)")
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out, "recoveries.png")
        _save_figure(fig, path)
        plt.close(fig)
        written.append(path)
    return written


PHASES = ("data", "forward/backward", "communication", "optimizer")


def write_trace(run_dir: str, path: str) -> int:
    """Writes a Chrome trace (chrome://tracing, Perfetto) of a run's steps: one row per rank,
    each step split into data loading, forward/backward, exposed communication and the
    optimizer, with failures, recoveries and resizes as instant events. Returns the number
    of trace events.

    Raises:
        ConfigError: `run_dir` has no metrics.jsonl, or its metrics carry no timeline.
    """

    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    if not metrics:
        raise ConfigError(f"{run_dir} has no metrics.jsonl; is it a run directory?")
    timed = [m for m in metrics if m.get("timeline")]
    if not timed:
        raise ConfigError(f"{run_dir} has no step timeline (written by elastic 0.1 and later)")
    origin = min(row[0] for m in timed for row in m["timeline"] if row)
    trace: list[dict] = []
    ranks = set()
    for m in timed:
        for rank, row in enumerate(m["timeline"]):
            if not row:
                continue
            ranks.add(rank)
            start = (row[0] - origin) * 1e6
            for name, duration in zip(PHASES, row[1:], strict=True):
                trace.append({"name": name, "cat": "step", "ph": "X", "pid": 0, "tid": rank,
                              "ts": round(start, 1), "dur": round(duration * 1e6, 1),
                              "args": {"step": m["step"], "world_size": m["world_size"],
                                       "generation": m.get("generation")}})
                start += duration * 1e6
    marks = {"worker_failure": "worker lost", "recovered": "ring rebuilt", "resized": "resized",
             "rebalanced": "shares rebalanced", "micro_batch_tuned": "micro-batch tuned",
             "oom_backoff": "out of memory", "checkpoint_written": "checkpoint"}
    for e in events:
        if e["event"] in marks and e["time"] >= origin:
            trace.append({"name": marks[e["event"]], "cat": "event", "ph": "i", "s": "g",
                          "pid": 0, "tid": 0, "ts": round((e["time"] - origin) * 1e6, 1),
                          "args": {k: v for k, v in e.items() if k not in ("time", "event")}})
    trace.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "elastic run"}})
    for rank in sorted(ranks):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                      "args": {"name": f"rank {rank}"}})
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    write_private(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}).encode(),
                  fsync=False)
    return len(trace)


def _save_figure(fig: Any, path: str) -> None:
    """A PNG as private as the run it shows (0600, never written through a link)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    write_private(path, buffer.getvalue(), fsync=False)
