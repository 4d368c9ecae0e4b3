"""`elastic report`: PNG plots of a run from its events.jsonl and metrics.jsonl."""

from __future__ import annotations

import io
import json
import os
from typing import Any

from elastic.errors import ConfigError
from elastic.events import (
    CheckpointWritten,
    Event,
    Generation,
    MicroBatchTuned,
    OomBackoff,
    Rebalanced,
    Recovered,
    Resized,
    WorkerFailure,
    read_events,
    record_fields,
)
from elastic.private import write_private
from elastic.runlog import read_jsonl

STAGES = (("detect_s", "detect"), ("abort_s", "abort"), ("rebuild_s", "rebuild"),
          ("restore_s", "restore"), ("first_step_s", "first step"))


def _read_metrics(run_dir: str) -> list[dict[str, Any]]:
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    if not metrics:
        if os.path.exists(os.path.join(run_dir, "events.jsonl")):
            raise ConfigError(f"the run in {run_dir} committed no step, so there is nothing to "
                              "plot; its events.jsonl (elastic logs) says how it went")
        raise ConfigError(f"{run_dir} has no metrics.jsonl; is it a run directory?")
    return metrics


def write_report(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Writes `training.png` (loss, throughput and world size over steps, failures and
    resizes marked) and, if the run recovered from failures, `recoveries.png` (each
    recovery's breakdown).

    Args:
        run_dir: the run directory (metrics.jsonl, events.jsonl).
        out_dir: where the PNGs go (default: `run_dir`).

    Returns:
        The paths written.

    Raises:
        ConfigError: `run_dir` has no metrics.jsonl.
    """
    metrics = _read_metrics(run_dir)
    events = read_events(run_dir)
    out = out_dir or run_dir
    os.makedirs(out, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    written = [_plot_training(metrics, events, f"run {os.path.basename(os.path.normpath(run_dir))}",
                              os.path.join(out, "training.png"))]
    recoveries = [e for e in events if isinstance(e, Recovered)]
    if recoveries:
        written.append(_plot_recoveries(recoveries, os.path.join(out, "recoveries.png")))
    return written


def markers(events: list[Event]) -> tuple[list[int], list[int]]:
    """The steps `training.png` marks: workers lost, and the world changing size without a
    loss (a scale request, workers joining, members leaving on notice)."""
    failures = [e.step for e in events if isinstance(e, WorkerFailure)]
    resizes = [e.step for e in events
               if isinstance(e, Generation) and e.reason in ("resize", "departure")]
    return failures, resizes


def _plot_training(metrics: list[dict[str, Any]], events: list[Event], title: str, path: str) -> str:
    """Loss, samples/s and workers over steps, with lost workers and resizes marked."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [m["step"] for m in metrics]
    failures, resizes = markers(events)
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
                       label="resize / join / departure" if i == 0 else None)
    axes[0].set_yscale("log")
    axes[2].yaxis.set_major_locator(MaxNLocator(integer=True))
    if failures or resizes:
        axes[0].legend(loc="upper right")
    axes[-1].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)
    return path


def _plot_recoveries(recoveries: list[Recovered], path: str) -> str:
    """One stacked bar per recovery: its stages in ms."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 1 + 0.8 * len(recoveries)), 4.5))
    labels = [f"step {r.step}\n{r.world_before}->{r.world_after}" for r in recoveries]
    bottom = [0.0] * len(recoveries)
    for key, name in STAGES:
        values = [1e3 * (getattr(r, key) or 0.0) for r in recoveries]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("ms")
    ax.set_title("recovery breakdown (kill to first completed step)")
    ax.legend()
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)
    return path


PHASES = ("data", "forward/backward", "communication", "optimizer")
# Events marked on the trace's timeline, by their name there.
MARKS: dict[type[Event], str] = {
    WorkerFailure: "worker lost", Recovered: "ring rebuilt", Resized: "resized",
    Rebalanced: "shares rebalanced", MicroBatchTuned: "micro-batch tuned",
    OomBackoff: "out of memory", CheckpointWritten: "checkpoint",
}


def write_trace(run_dir: str, path: str) -> int:
    """Writes a Chrome trace (chrome://tracing, Perfetto) of a run's steps: one row per rank,
    each step split into data loading, forward/backward, exposed communication and the
    optimizer, with failures, recoveries and resizes as instant events.

    Args:
        run_dir: the run directory (metrics.jsonl, events.jsonl).
        path: the trace's JSON file.

    Returns:
        The number of trace events.

    Raises:
        ConfigError: `run_dir` has no metrics.jsonl, or its metrics carry no timeline.
    """
    metrics = _read_metrics(run_dir)
    timed = [m for m in metrics if m.get("timeline")]
    if not timed:
        raise ConfigError(f"{run_dir} has no step timeline (written by elastic 0.1 and later)")
    origin = min(row[0] for m in timed for row in m["timeline"] if row)
    trace, ranks = _step_spans(timed, origin)
    for e in read_events(run_dir):
        name = MARKS.get(type(e))
        if name is not None and e.time is not None and e.time >= origin:
            trace.append({"name": name, "cat": "event", "ph": "i", "s": "g",
                          "pid": 0, "tid": 0, "ts": round((e.time - origin) * 1e6, 1),
                          "args": record_fields(e)})
    trace.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "elastic run"}})
    for rank in sorted(ranks):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                      "args": {"name": f"rank {rank}"}})
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    write_private(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}).encode(),
                  fsync=False)
    return len(trace)


def _step_spans(timed: list[dict[str, Any]], origin: float) -> tuple[list[dict], set[int]]:
    """The phases of every step on every rank as trace spans; and the ranks seen."""
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
    return trace, ranks


def _save_figure(fig: Any, path: str) -> None:
    """A PNG as private as the run it shows (0600, never written through a link)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    write_private(path, buffer.getvalue(), fsync=False)
