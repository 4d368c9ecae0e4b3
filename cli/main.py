"""`elastic` command line. Each command parses, calls the Python API, prints, exits.

Bad input exits with code 2 and one line naming what to fix.
"""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import statistics
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, get_type_hints

import pydantic
import typer
from rich.console import Console
from rich.table import Table

import elastic
from elastic.config import ALGORITHMS, CollectiveConfig
from elastic.errors import ElasticError
from elastic.runlog import read_jsonl

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Elastic, fault-tolerant data-parallel training on Ray.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print a table and write JSON.")
app.add_typer(bench_app, name="bench")
console = Console()


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {message}")
    return typer.Exit(code=2)


def _save(path: pathlib.Path | None, write: Callable[[pathlib.Path], object]) -> None:
    """Writes an output the user asked for (`--json`, `--plot`), creating its folder."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path)
    console.print(f"wrote {path}")


def _save_json(path: pathlib.Path | None, data: dict) -> None:
    _save(path, lambda p: p.write_text(json.dumps(data, indent=2)))


def _human(size: int) -> str:
    for unit, factor in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


@bench_app.command("allreduce")
def bench_allreduce(
    world_size: Annotated[int, typer.Option(help="Number of ranks (processes).")] = 4,
    sizes: Annotated[str, typer.Option(help="Comma-separated message sizes.")] = "4KB,64KB,1MB,16MB,64MB",
    algorithms: Annotated[str, typer.Option(help="Comma-separated algorithms.")] = ",".join(ALGORITHMS),
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot: Annotated[pathlib.Path | None, typer.Option(help="Write a busbw plot (PNG) here.")] = None,
    shared_memory: Annotated[bool, typer.Option(
        help="Point-to-point algorithms move bytes through shared memory (as in training on "
             "one host); off: through gloo's TCP send/recv. 'native' is gloo's own allreduce "
             "either way.")] = True,
    segment_bytes: Annotated[str, typer.Option(help="Ring segment size.")] = "16MB",
) -> None:
    """Time every allreduce algorithm at every size, check results, fit alpha-beta."""
    from elastic.bench.allreduce import parse_size, plot_allreduce, run_allreduce_bench

    try:
        size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
    except ValueError as e:
        raise _fail(f"--sizes: {e}") from None
    try:
        segment = parse_size(segment_bytes)
    except ValueError as e:
        raise _fail(f"--segment-bytes: {e}") from None
    algorithm_list = [a.strip() for a in algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithm_list if a not in ALGORITHMS]
    if unknown:
        raise _fail(f"--algorithms: unknown {', '.join(unknown)}; choose from {', '.join(ALGORITHMS)}")
    try:
        result = run_allreduce_bench(world_size, size_list, algorithm_list,  # type: ignore[arg-type]
                                     segment_bytes=segment, shared_memory=shared_memory)
    except ValueError as e:
        raise _fail(str(e)) from None
    table = Table(title=f"allreduce, {world_size} ranks (memcpy {result.memcpy_gbps:.2f} GB/s, "
                        f"loopback TCP {result.loopback_tcp_gbps:.2f} GB/s)")
    for column in ("algorithm", "transport", "size", "median ms", "algbw GB/s", "busbw GB/s",
                   "busbw / TCP", "correct"):
        table.add_column(column, justify="right")
    for r in result.records:
        table.add_row(r.algorithm, r.transport, _human(r.size_bytes), f"{r.median_s * 1e3:.3f}",
                      f"{r.algbw_gbps:.3f}", f"{r.busbw_gbps:.3f}",
                      f"{r.busbw_gbps / result.loopback_tcp_gbps:.0%}", "yes" if r.correct else "NO")
    console.print(table)
    fits = Table(title="alpha-beta fit: t = alpha + beta * bytes")
    for column in ("algorithm", "alpha us", "1/beta GB/s", "R^2"):
        fits.add_column(column, justify="right")
    for name, fit in result.fits.items():
        inv = 1 / fit.beta_s_per_byte / 1e9 if fit.beta_s_per_byte > 0 else float("inf")
        fits.add_row(name, f"{fit.alpha_s * 1e6:.1f}", f"{inv:.3f}", f"{fit.r_squared:.4f}")
    console.print(fits)
    cross = result.ring_beats_tree_from_bytes
    console.print(f"ring beats tree from: {_human(cross) if cross else 'no measured size'}")
    _save_json(json_path, result.to_json())
    _save(plot, lambda path: plot_allreduce(result, str(path)))
    if not all(r.correct for r in result.records):
        raise _fail("some results were wrong (see the 'correct' column)")


@bench_app.command("recovery")
def bench_recovery(
    workers: Annotated[int, typer.Option(help="Workers in the run.")] = 4,
    trials: Annotated[int, typer.Option(help="Kills (one recovery each).")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the kill schedule.")] = 0,
    replace: Annotated[bool, typer.Option(
        "--replace/--no-replace", help="Replacements start at once (default), or not: the run "
        "goes on with the survivors and is scaled back up after each recovery.")] = True,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """SIGKILL a random worker at a random phase TRIALS times in one run; time each recovery."""
    from elastic.bench.recovery import run_recovery_bench

    try:
        result = run_recovery_bench(workers, trials, seed=seed, replace=replace)
    except (ValueError, ElasticError) as e:
        raise _fail(_one_line(e)) from None
    table = Table(title=f"recovery from SIGKILL, {workers} workers, {len(result.recoveries)} recoveries")
    for column in ("stage", "median ms", "max ms"):
        table.add_column(column, justify="right")
    for stage in result.stages:
        table.add_row(stage.stage.removesuffix("_s"), f"{stage.median_s * 1e3:.1f}",
                      f"{stage.max_s * 1e3:.1f}")
    console.print(table)
    console.print(f"replacements joined: {result.joins}; work lost per failure (steps): "
                  f"{result.work_lost_steps}; run dir {result.run_dir}")
    _save_json(json_path, result.to_json())


@bench_app.command("adapt")
def bench_adapt(
    workers: Annotated[int, typer.Option(help="Workers in the run (the last one is slowed).")] = 4,
    slow_factor: Annotated[float, typer.Option(help="How many times slower the slow worker is.")] = 2.0,
    steps: Annotated[int, typer.Option(help="Steps in the run.")] = 64,
    batch: Annotated[int, typer.Option(help="Global batch size.")] = 256,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Slow one worker down; compare step time on the even split with that after rebalancing."""
    from elastic.bench.adapt import run_adapt_bench

    try:
        r = run_adapt_bench(workers, slow_factor, steps, batch)
    except (ValueError, RuntimeError, ElasticError) as e:
        raise _fail(_one_line(e)) from None
    table = Table(title=f"one of {workers} workers {slow_factor:g}x slower, global batch {batch}")
    for column in ("split", "shares", "steps", "median step ms"):
        table.add_column(column, justify="right")
    table.add_row("even", str(r.shares_even), str(r.even_steps), f"{r.even_median_s * 1e3:.1f}")
    table.add_row("rebalanced", str(r.shares_rebalanced), str(r.rebalanced_steps),
                  f"{r.rebalanced_median_s * 1e3:.1f}")
    console.print(table)
    console.print(f"rebalanced / even step time: {r.ratio:.2f}x ({len(r.rebalances)} rebalance(s)); "
                  f"run dir {r.run_dir}")
    _save_json(json_path, r.to_json())


@bench_app.command("overhead")
def bench_overhead(
    workers: Annotated[int, typer.Option(help="World size of both runs.")] = 2,
    model: Annotated[str, typer.Option(help="mlp or cnn.")] = "mlp",
    steps: Annotated[int, typer.Option(help="Steps of each run.")] = 40,
    batch: Annotated[int, typer.Option(help="Global batch size.")] = 256,
    algorithm: Annotated[str, typer.Option(help="Our allreduce algorithm.")] = CollectiveConfig().algorithm,
    overlap: Annotated[bool | None, typer.Option(
        "--overlap/--no-overlap", help="Overlap gradient buckets with backward (default: the "
        "backend's default, off for gloo).")] = None,
    rounds: Annotated[int, typer.Option(
        help="Runs of each, alternating; the ratio is the median of the per-round ratios.")] = 3,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """elastic.fit against a plain torch DDP loop: same model, data, batch and world size."""
    from elastic.bench.overhead import run_overhead_bench

    try:
        r = run_overhead_bench(workers, model, steps, batch, algorithm=algorithm, overlap=overlap,
                               rounds=rounds)
    except (ValueError, ElasticError) as e:
        raise _fail(_one_line(e)) from None
    table = Table(title=f"{model} ({r.parameters:,} parameters), {workers} workers, global batch {batch}")
    for column in ("", "median step ms", "wall ms / step"):
        table.add_column(column, justify="right")
    table.add_row("elastic.fit", f"{r.elastic_step_median_s * 1e3:.1f}",
                  f"{r.elastic_wall_per_step_s * 1e3:.1f}")
    table.add_row("torch DDP (gloo)", f"{r.ddp_step_median_s * 1e3:.1f}",
                  f"{r.ddp_wall_per_step_s * 1e3:.1f}")
    table.add_row("ratio", f"{r.step_ratio:.2f}x", f"{r.wall_ratio:.2f}x")
    console.print(table)
    if len(r.rounds) > 1:
        console.print("per-round step ratios: " + ", ".join(
            f"{x['step_ratio']:.2f}x" for x in r.rounds) + " (wall: " + ", ".join(
            f"{x['wall_ratio']:.2f}x" for x in r.rounds) + ")")
    console.print(f"elastic medians: forward/backward {r.elastic_forward_backward_median_s * 1e3:.1f} ms, "
                  f"exposed communication {r.elastic_comm_median_s * 1e3:.1f} ms "
                  f"(algorithm {r.algorithm}, overlap {'on' if r.overlap else 'off'})")
    _save_json(json_path, r.to_json())


@bench_app.command("scaling")
def bench_scaling(
    model: Annotated[str, typer.Option(help="mlp95, alexnet, googlenet or resnet50.")] = "mlp95",
    workers: Annotated[str, typer.Option(help="Comma-separated worker counts.")] = "1,2,4",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated global batch sizes.")] = "64,128,256,512",
    steps: Annotated[int, typer.Option(help="Steps per run.")] = 24,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot: Annotated[pathlib.Path | None, typer.Option(help="Write a PNG plot here.")] = None,
) -> None:
    """Samples/s and scaling efficiency against workers and batch; projection to 256 workers."""
    from elastic.bench.scaling import plot_scaling, run_scaling_bench

    try:
        worker_list = [int(x) for x in workers.split(",") if x]
        batch_list = [int(x) for x in batch_sizes.split(",") if x]
        r = run_scaling_bench(model, worker_list, batch_list, steps)
    except (ValueError, ElasticError) as e:
        raise _fail(_one_line(e)) from None
    table = Table(title=f"{model}: {r.parameters:,} parameters "
                  f"({r.gradient_bytes / 1e6:.2f} MB of gradients)")
    for column in ("workers", "global batch", "samples/s", "efficiency", "step ms", "compute ms", "comm ms"):
        table.add_column(column, justify="right")
    for p in r.points:
        table.add_row(str(p.workers), str(p.global_batch_size), f"{p.samples_per_s:.0f}",
                      f"{p.efficiency:.2f}", f"{p.step_s * 1e3:.1f}", f"{p.compute_s * 1e3:.1f}",
                      f"{p.comm_s * 1e3:.1f}")
    console.print(table)
    projected = ", ".join(f"{p.workers}: {p.samples_per_s:.0f}/s ({p.efficiency:.2f})" for p in r.projection)
    bandwidth = 1 / r.beta_s_per_byte / 1e9 if r.beta_s_per_byte else float("inf")
    console.print(f"projection at B={r.projection_batch} (compute {r.compute_per_sample_s * 1e6:.1f} "
                  f"us/sample, alpha {r.alpha_s * 1e3:.3f} ms, 1/beta {bandwidth:.2f} GB/s): {projected}")
    _save_json(json_path, r.to_json())
    _save(plot, lambda path: plot_scaling(r, str(path)))


@bench_app.command("control")
def bench_control(
    calls: Annotated[int, typer.Option(help="Calls of each command.")] = 20,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Time `elastic status/list/scale/kill/stop` as typed (a process each) on a live run."""
    from elastic.bench.control import run_control_bench

    try:
        r = run_control_bench(calls)
    except (ValueError, RuntimeError, TimeoutError, ElasticError) as e:
        raise _fail(_one_line(e)) from None
    table = Table(title=f"control commands on a live local run, {calls} calls each")
    for column in ("command", "median ms", "max ms", "from Python, median ms"):
        table.add_column(column, justify="right")
    for c in r.commands:
        table.add_row(f"elastic {c.command}", f"{c.cli_median_s * 1e3:.0f}", f"{c.cli_max_s * 1e3:.0f}",
                      f"{c.python_median_s * 1e3:.1f}" if c.python_median_s is not None else "-")
    console.print(table)
    for label, values in (("down", r.scale_down_to_step_s), ("up", r.scale_up_to_step_s)):
        if values:
            console.print(f"elastic scale {label} -> first step at the new size: median "
                          f"{statistics.median(values) * 1e3:.0f} ms, max {max(values) * 1e3:.0f} ms "
                          f"({len(values)} resizes)")
    _save_json(json_path, r.to_json())


@bench_app.command("checkpoint")
def bench_checkpoint(
    size_mb: Annotated[int, typer.Option(help="State size in MiB (model + optimizer).")] = 256,
    trials: Annotated[int, typer.Option(help="Repetitions (medians are reported).")] = 3,
    directory: Annotated[str | None, typer.Option(help="Where to write (default: a temp dir).")] = None,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Async checkpoint stall vs a synchronous save; write throughput vs a plain fsynced write."""
    from elastic.bench.checkpoint import run_checkpoint_bench

    try:
        r = run_checkpoint_bench(size_mb, trials, directory)
    except ValueError as e:
        raise _fail(str(e)) from None
    table = Table(title=f"checkpoint of {r.state_bytes / 1e6:.0f} MB, median of {r.trials}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("synchronous save (s)", f"{r.sync_save_s:.3f}")
    table.add_row("asynchronous stall (s)", f"{r.async_stall_s:.3f}")
    table.add_row("stall / synchronous save", f"{r.stall_fraction:.1%}")
    table.add_row("checkpoint write (GB/s)", f"{r.checkpoint_write_gbps:.3f}")
    table.add_row("plain fsynced write (GB/s)", f"{r.plain_write_gbps:.3f}")
    table.add_row("checkpoint / plain", f"{r.write_fraction:.1%}")
    console.print(table)
    _save_json(json_path, r.to_json())


def _load_config_file(path: pathlib.Path) -> dict:
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        return tomllib.loads(text)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(text) or {}
    raise ValueError(f"--config {path}: use a .toml or .yaml file")


def _set(tree: dict, dotted: str, value: object) -> None:
    if value is None:
        return
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def _one_line(e: Exception) -> str:
    if isinstance(e, pydantic.ValidationError):
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "config"
        return f"invalid configuration: {where}: {first['msg']} ({e.error_count()} problem(s))"
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _describe(event: dict) -> str | None:
    kind = event["event"]
    if kind == "worker_failure":
        ranks = ", ".join(map(str, event["lost_ranks"])) or "none"
        if event.get("planned"):
            return (f"killed rank {ranks} on purpose at step {event['step']}; "
                    f"{event['survivors']} survivors go on")
        reasons = "; ".join(r for r in event.get("reasons", []) if r)
        return (f"worker lost: rank {ranks} at step {event['step']}, {event['survivors']} survivors"
                + (f" (Ray: {reasons})" if reasons else ""))
    if kind == "recovered":
        return (f"ring rebuilt {event['world_before']} -> {event['world_after']} workers in "
                f"{event['total_s']:.2f} s (abort {event['abort_s'] * 1e3:.0f} ms, rebuild "
                f"{event['rebuild_s'] * 1e3:.0f} ms, restore {event['restore_s'] * 1e3:.0f} ms, "
                f"first step {event['first_step_s'] * 1e3:.0f} ms)")
    if kind == "worker_joined":
        return f"worker {event['worker_id']} joined"
    if kind == "resized":
        return f"resized to {event['world_size']} workers (generation {event['generation']})"
    if kind == "user_error":
        return f"user code raised at step {event['step']} on ranks {event['ranks']}: {event['error']}"
    if kind == "evaluate":
        metrics = {k: v for k, v in event.items() if k not in ("time", "event", "step", "epoch")}
        return f"epoch {event['epoch']} evaluation: {metrics}"
    if kind == "micro_batch_tuned":
        rates = ", ".join(f"{k}: {v:.0f}/s" for k, v in event["samples_per_s"].items())
        return f"micro-batch {event['micro_batch']} chosen after trying {rates}"
    if kind == "oom_backoff":
        return (f"out of memory on rank {event['rank']} at step {event['step']}: micro-batch "
                f"{event['micro_batch_before']} -> {event['micro_batch_after']}, step redone")
    if kind == "rebalanced":
        return (f"shares rebalanced {event['shares_before']} -> {event['shares_after']} "
                f"(predicted compute {event['predicted_before_s'] * 1e3:.0f} -> "
                f"{event['predicted_after_s'] * 1e3:.0f} ms)")
    if kind == "rebalance_judged" and not event["delivered"]:
        return (f"the re-split saved {event['realised_saving_s'] * 1e3:.1f} ms of a predicted "
                f"{event['predicted_saving_s'] * 1e3:.1f} ms; the next one needs "
                f"{event['threshold']:.0%} and is watched for {event['window']} chunks")
    if kind == "batch_planned":
        return (f"global batch {event['global_batch_size']} for {event['world_size']} workers, "
                f"learning-rate factor {event['lr_factor_from']:.3g} -> {event['lr_factor_to']:.3g} "
                f"over {event['warmup_steps']} steps")
    if kind == "checkpoint_written":
        return f"checkpoint of step {event['step']} written in {event['seconds']:.2f} s"
    if kind == "chaos" and event["action"] == "kill":
        return None  # the failure it causes is described as planned
    if kind in ("worker_hung", "stopping", "failed", "chaos"):
        return f"{kind}: {({k: v for k, v in event.items() if k not in ('time', 'event')})}"
    return None


class _EventTail:
    """Prints a run's events as they are appended to its events.jsonl."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.seen = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            self.flush()

    def flush(self) -> None:
        events = read_jsonl(str(self.path))
        for event in events[self.seen:]:
            line = _describe(event)
            if line:
                console.print(f"[cyan]event[/cyan] {line}")
        self.seen = len(events)


# Command-line option -> dotted FitConfig field; `run` and `start` share them.
_OPTION_FIELDS = {
    "workers": "scaling.num_workers", "min_workers": "scaling.min_workers",
    "max_workers": "scaling.max_workers", "global_batch": "batch.global_batch_size",
    "max_micro_batch": "batch.max_micro_batch", "batch_policy": "batch.policy",
    "epochs": "epochs", "max_steps": "max_steps",
    "seed": "seed", "name": "name", "run_dir": "run_dir", "backend": "collective.backend",
    "algorithm": "collective.algorithm",
}


def _overrides(options: dict[str, Any]) -> dict[str, object]:
    return {dotted: options[option] for option, dotted in _OPTION_FIELDS.items()}


def _prepare(options: dict[str, Any]) -> tuple[elastic.FitConfig, elastic.TrainJob]:
    """Config file, then command-line overrides, then the target; one line on bad input."""
    config: pathlib.Path | None = options["config"]
    try:
        tree = _load_config_file(config) if config else {}
        for dotted, value in _overrides(options).items():
            _set(tree, dotted, value)
        if options["ledger"]:
            tree["ledger"] = True
        chaos = list(tree.get("chaos", []))
        for item in options["kill_at"] or []:
            step, sep, rank = item.partition(":")
            if not sep or not step.isdigit() or not rank.isdigit():
                raise ValueError(f"--kill-at {item!r} must be STEP:RANK, e.g. 20:1")
            chaos.append({"step": int(step), "rank": int(rank), "action": "kill"})
        if chaos:
            tree["chaos"] = chaos
        fit_config = elastic.FitConfig(**tree)
        job = elastic.load_target(options["target"])
    except Exception as e:
        if options["debug"]:
            raise
        raise _fail(_one_line(e)) from None
    if options["address"]:
        os.environ["RAY_ADDRESS"] = options["address"]
    return fit_config, job


def _training_options(
    target: Annotated[str, typer.Argument(help="path/to/file.py:job or package.module:job")],
    workers: Annotated[int | None, typer.Option(help="Workers to start with.")] = None,
    min_workers: Annotated[int | None, typer.Option(help="Fewest workers to continue with.")] = None,
    max_workers: Annotated[int | None, typer.Option(help="Most workers to grow to.")] = None,
    global_batch: Annotated[int | None, typer.Option(help="Samples per optimizer step.")] = None,
    max_micro_batch: Annotated[int | None, typer.Option(help="Micro-batch cap per worker.")] = None,
    batch_policy: Annotated[str | None, typer.Option(
        help="'fixed' (default) or 'scale_with_workers' (batch and learning rate follow the "
        "world size).")] = None,
    epochs: Annotated[int | None, typer.Option(help="Epochs to train.")] = None,
    max_steps: Annotated[int | None, typer.Option(help="Optimizer steps to train.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the model and the sample order.")] = None,
    name: Annotated[str | None, typer.Option(help="Run name, for status/scale/kill/stop.")] = None,
    run_dir: Annotated[str | None, typer.Option(help="Where events and metrics go.")] = None,
    backend: Annotated[str | None, typer.Option(help="gloo or nccl.")] = None,
    algorithm: Annotated[str | None, typer.Option(help="ring, tree, halving_doubling, native.")] = None,
    kill_at: Annotated[list[str] | None, typer.Option(help="Chaos: kill RANK at STEP (STEP:RANK).")] = None,
    ledger: Annotated[bool, typer.Option(help="Record the indices of every step.")] = False,
    config: Annotated[pathlib.Path | None, typer.Option(help="TOML or YAML FitConfig file.")] = None,
    address: Annotated[str | None, typer.Option(
        help="Ray cluster address (default: RAY_ADDRESS; `run` starts a local cluster if there "
        "is none).")] = None,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """The options `run` and `start` share, declared once (see `_training_command`)."""


def _training_command(body: Callable[[dict[str, Any]], None]) -> Callable[..., None]:
    """A command with the options of `_training_options`, handed to `body` as one dict."""

    def command(**options: Any) -> None:
        body(options)

    command.__name__, command.__doc__ = body.__name__, body.__doc__
    command.__signature__ = inspect.signature(_training_options, eval_str=True)  # type: ignore[attr-defined]
    command.__annotations__ = get_type_hints(_training_options, include_extras=True)
    return command


@app.command()
@_training_command
def run(options: dict[str, Any]) -> None:
    """Train TARGET in the foreground, printing recovery events as they happen."""
    fit_config, job = _prepare(options)
    debug = options["debug"]
    run_name = fit_config.name or f"run-{os.getpid()}"
    fit_config = fit_config.model_copy(update={"name": run_name})
    directory = pathlib.Path(fit_config.run_dir or os.path.join("runs", run_name))
    console.print(f"run [bold]{run_name}[/bold]: {fit_config.scaling.num_workers} workers, "
                  f"global batch {fit_config.batch.global_batch_size}, run dir {directory}")
    tail = _EventTail(directory / "events.jsonl")
    tail.thread.start()
    try:
        result = elastic.fit(job, fit_config)
    except ElasticError as e:
        tail.stop.set()
        tail.flush()
        if debug:
            raise
        raise _fail(f"{type(e).__name__}: {_one_line(e)}") from None
    tail.stop.set()
    tail.thread.join()
    tail.flush()
    summary = Table(title=f"run {result.name}")
    summary.add_column("")
    summary.add_column("", justify="right")
    last = result.metrics[-1] if result.metrics else {}
    recoveries = [e for e in result.events if e["event"] == "recovered"]
    for key, value in (
        ("steps", result.steps), ("samples", result.samples),
        ("final loss", f"{last.get('loss', float('nan')):.4f}"),
        ("world size at the end", last.get("world_size", "-")),
        ("recoveries", len(recoveries)),
        ("stopped early", "yes" if result.stopped else "no"),
        *((k, f"{v:.4f}") for k, v in result.evaluation.items()),
    ):
        summary.add_row(str(key), str(value))
    console.print(summary)


@app.command()
@_training_command
def start(options: dict[str, Any]) -> None:
    """Start TARGET as a detached run on a running Ray cluster and return at once."""
    fit_config, job = _prepare(options)
    try:
        run_name = elastic.start(job, fit_config)
    except ElasticError as e:
        if options["debug"]:
            raise
        raise _fail(_one_line(e)) from None
    console.print(f"started run {run_name}; follow it with `elastic status {run_name}`")


@app.command()
def demo(
    workers: Annotated[int, typer.Option(help="Workers.")] = 4,
    epochs: Annotated[int, typer.Option(help="Epochs over the digits data set.")] = 30,
    run_dir: Annotated[str | None, typer.Option(help="Where both runs go (default: temp).")] = None,
) -> None:
    """Digits MLP on 4 workers with one killed part-way, next to an uninterrupted run."""
    from elastic.demo import run_demo

    console.print(f"training the digits MLP twice on {workers} workers: once with worker 1 "
                  "killed at step 30, once uninterrupted")
    result = run_demo(workers=workers, epochs=epochs, run_dir=run_dir)
    for event in result.elastic.events:
        line = _describe(event)
        if line and event["event"] != "evaluate":
            console.print(f"[cyan]event[/cyan] {line}")
    table = Table(title="digits, final accuracy on the data set")
    for column in ("run", "steps", "world sizes", "recoveries", "accuracy"):
        table.add_column(column, justify="right")
    for label, r in (("with a worker killed", result.elastic), ("uninterrupted", result.uninterrupted)):
        sizes = sorted({m["world_size"] for m in r.metrics}, reverse=True)
        table.add_row(label, str(r.steps), ",".join(map(str, sizes)),
                      str(sum(e["event"] == "recovered" for e in r.events)),
                      f"{r.evaluation.get('accuracy', float('nan')):.4f}")
    console.print(table)
    console.print(f"run dirs: {result.elastic.run_dir}, {result.uninterrupted.run_dir}; "
                  f"plots: elastic report {result.elastic.run_dir}")


@app.command()
def report(
    run_dir: Annotated[pathlib.Path, typer.Argument(help="A run directory.")],
    out: Annotated[pathlib.Path | None, typer.Option(help="Where to write the PNGs.")] = None,
    trace: Annotated[pathlib.Path | None, typer.Option(
        help="Also write a Chrome trace (chrome://tracing, Perfetto) of the steps here.")] = None,
) -> None:
    """Plot a run: loss, throughput and world size over steps; recovery breakdowns."""
    from elastic.report import write_report, write_trace

    try:
        paths = write_report(str(run_dir), str(out) if out else None)
        if trace is not None:
            count = write_trace(str(run_dir), str(trace))
            paths.append(f"{trace} ({count} trace events)")
    except ElasticError as e:
        raise _fail(_one_line(e)) from None
    for path in paths:
        console.print(f"wrote {path}")


@app.command("list")
def list_runs(
    live: Annotated[bool, typer.Option("--live", help="Only the runs still going.")] = False,
) -> None:
    """List runs, live and ended, newest first, with their state."""
    records = elastic.runs(live_only=live)
    if not records:
        console.print("no live runs" if live else "no runs")
        return
    # Names are never cut (folded at worst): they are what users copy. `elastic status NAME`
    # has the run dir and the rest.
    table = Table()
    table.add_column("name", overflow="fold")
    for column in ("state", "step", "last loss", "started", "ended"):
        table.add_column(column, no_wrap=True)
    for r in records:
        table.add_row(r["name"], r["state"], f"{r['step']}/{r['total_steps']}", _loss(r.get("last_loss")),
                      _when(r.get("started_at")), _when(r.get("ended_at")))
    # Piped output (80 columns by default) gets room for whole rows.
    (console if console.is_terminal else Console(width=160)).print(table)


def _when(timestamp: float | None) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(timestamp)) if timestamp else "-"


def _loss(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "-"


@app.command()
def logs(name: Annotated[str, typer.Argument(help="Run name.")]) -> None:
    """Print a run's events so far (live or ended)."""
    try:
        events = elastic.events(name)
    except ElasticError as e:
        raise _fail(_one_line(e)) from None
    for event in events:
        line = _describe(event) or event["event"]
        console.print(f"{event['event']:>16}  {line}")


@app.command()
def status(
    name: Annotated[str, typer.Argument(help="Run name.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show a run's state, step and workers; for an ended run, how it ended."""
    try:
        info = elastic.status(name)
    except ElasticError as e:
        raise _fail(_one_line(e)) from None
    if as_json:
        console.print_json(json.dumps(info))
        return
    line = (f"run {info['name']}: {info['state']}, step {info['step']}/{info['total_steps']}, "
            f"last loss {_loss(info.get('last_loss'))}, started {_when(info.get('started_at'))}")
    if info.get("ended_at"):
        line += f", ended {_when(info['ended_at'])}"
    console.print(line + f", {info['failures']} failures; run dir {info['run_dir']}")
    if info.get("error_type"):
        console.print(f"error: {info['error_type']}: {info['error_message']}")
    if info["state"] == "lost":
        console.print("its controller no longer answers and recorded no end: the process or the Ray "
                      "cluster stopped before the run could finish")
    if not info["workers"]:
        return
    console.print(f"{info['world_size']} workers (target {info['target_workers']}), "
                  f"generation {info['generation']}")
    table = Table()
    for column in ("rank", "worker", "pid", "node"):
        table.add_column(column)
    for w in info["workers"]:
        table.add_row(str(w["rank"]), str(w["worker_id"]), str(w["pid"]), w["node_id"][:12])
    console.print(table)


@app.command()
def scale(name: Annotated[str, typer.Argument(help="Run name.")],
          num_workers: Annotated[int, typer.Argument(help="New number of workers.")]) -> None:
    """Grow or shrink a live run at its next step boundary."""
    try:
        elastic.scale(name, num_workers)
    except ElasticError as e:
        raise _fail(_one_line(e)) from None
    console.print(f"run {name}: scaling to {num_workers} workers at the next step boundary")


@app.command()
def kill(name: Annotated[str, typer.Argument(help="Run name.")],
         rank: Annotated[int, typer.Option(help="Rank of the worker to kill.")]) -> None:
    """Kill one worker of a live run (the run recovers)."""
    try:
        elastic.kill(name, rank)
    except ElasticError as e:
        raise _fail(_one_line(e)) from None
    console.print(f"run {name}: killed rank {rank}")


@app.command()
def stop(name: Annotated[str, typer.Argument(help="Run name.")]) -> None:
    """Stop a live run gracefully at its next step boundary."""
    try:
        elastic.stop(name)
    except ElasticError as e:
        raise _fail(_one_line(e)) from None
    console.print(f"run {name}: stopping at the next step boundary")


def main() -> None:
    app()
