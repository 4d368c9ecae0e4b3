"""`elastic bench ...`: each benchmark runs through `elastic.bench`, prints a table and writes
JSON (`--json`) or a plot (`--plot`) if asked."""

from __future__ import annotations

import pathlib
import statistics
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from cli.output import console, fail, one_line, save, save_json
from elastic.config import ALGORITHMS, CollectiveConfig, FitConfig
from elastic.errors import ElasticError

if TYPE_CHECKING:
    from elastic.bench.allreduce import AllreduceBenchResult
    from elastic.bench.overhead import OverheadResult

app = typer.Typer(no_args_is_help=True, help="Benchmarks that print a table and write JSON.")


def _names(text: str) -> list[str]:
    """A comma-separated option's items, blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _numbers(option: str, text: str, least: int = 0, example: str = "1,2") -> list[int]:
    """A comma-separated option's whole numbers, each at least `least`.

    Raises:
        typer.Exit: (code 2) one line naming `option` and what it takes.
    """
    try:
        values = [int(part) for part in _names(text)]
    except ValueError:
        raise fail(f"{option}: whole numbers separated by commas (such as {example}), "
                   f"got {text!r}") from None
    if not values or min(values) < least:
        raise fail(f"{option}: at least one number, each {least} or more, got {text!r}")
    return values


def _human(size: int) -> str:
    for unit, factor in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


@app.command("allreduce")
def bench_allreduce(
    world_size: Annotated[int, typer.Option(help="Number of ranks (processes).")] = 4,
    sizes: Annotated[str, typer.Option(help="Comma-separated message sizes.")] = "4KB,64KB,1MB,16MB,64MB",
    algorithms: Annotated[str, typer.Option(help="Comma-separated algorithms.")] = ",".join(
        a for a in ALGORITHMS if a != "auto"),
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
    plot: Annotated[pathlib.Path | None, typer.Option(help="Write a busbw plot (PNG) here.")] = None,
    shared_memory: Annotated[bool, typer.Option(
        help="Point-to-point algorithms move bytes through shared memory (as in training on "
             "one host); off: through gloo's TCP send/recv. 'native' is gloo's own allreduce "
             "either way.")] = True,
    segment_bytes: Annotated[str, typer.Option(help="Ring segment size.")] = "16MB",
    hosts: Annotated[int, typer.Option(help="Simulated hosts: the ranks act as this many hosts "
                                            "(shared memory inside each, TCP between).")] = 1,
    registered: Annotated[bool, typer.Option(
        help="Also measure 'direct', 'hierarchical' and 'auto' on a registered buffer (shared "
             "memory the communicator lends, as training's flat gradient buffers are), in rows "
             "named '<algorithm> (registered)'.")] = True,
) -> None:
    """Time every allreduce algorithm at every size, check results, fit alpha-beta."""
    from elastic.bench.allreduce import parse_size, plot_allreduce, run_allreduce_bench

    try:
        size_list = [parse_size(s) for s in _names(sizes)]
    except ValueError as e:
        raise fail(f"--sizes: {e}") from None
    try:
        segment = parse_size(segment_bytes)
    except ValueError as e:
        raise fail(f"--segment-bytes: {e}") from None
    algorithm_list = _names(algorithms)
    unknown = [a for a in algorithm_list if a not in ALGORITHMS]
    if unknown:
        raise fail(f"--algorithms: unknown {', '.join(unknown)}; choose from {', '.join(ALGORITHMS)}")
    try:
        result = run_allreduce_bench(world_size, size_list, algorithm_list,  # type: ignore[arg-type]
                                     segment_bytes=segment, shared_memory=shared_memory,
                                     hosts=hosts, registered=registered)
    except ValueError as e:
        raise fail(str(e)) from None
    _print_allreduce(result, world_size, hosts)
    save_json(json_path, result.to_json())
    save(plot, lambda path: plot_allreduce(result, str(path)))
    if not all(r.correct for r in result.records):
        raise fail("some results were wrong (see the 'correct' column)")


def _print_allreduce(result: AllreduceBenchResult, world_size: int, hosts: int) -> None:
    """The measurements, the alpha-beta fits and where ring overtakes tree."""
    where = f"{hosts} simulated hosts" if hosts > 1 else "one host"
    table = Table(title=f"allreduce, {world_size} ranks on {where} (memcpy "
                        f"{result.memcpy_gbps:.2f} GB/s, loopback TCP {result.loopback_tcp_gbps:.2f} GB/s)")
    for column in ("algorithm", "transport", "size", "median ms", "algbw GB/s", "busbw GB/s",
                   "busbw / TCP", "busbw / memcpy", "correct"):
        table.add_column(column, justify="right")
    for r in result.records:
        table.add_row(r.algorithm, r.transport, _human(r.size_bytes), f"{r.median_s * 1e3:.3f}",
                      f"{r.algbw_gbps:.3f}", f"{r.busbw_gbps:.3f}",
                      f"{r.busbw_gbps / result.loopback_tcp_gbps:.0%}",
                      f"{result.memcpy_fraction(r):.0%}", "yes" if r.correct else "NO")
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


@app.command("recovery")
def bench_recovery(
    workers: Annotated[int, typer.Option(help="Workers in the run.")] = 4,
    trials: Annotated[int, typer.Option(help="Kills (one recovery each).")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the kill schedule.")] = 0,
    replace: Annotated[bool, typer.Option(
        "--replace/--no-replace", help="Replacements start at once (default), or not: the run "
        "goes on with the survivors and is scaled back up after each recovery.")] = True,
    sharding_stage: Annotated[int, typer.Option(
        help="1: the optimizer state sharded over 2 owners per parameter (SGD with momentum), "
        "moved at each recovery; 2: the summed gradients sharded too.")] = 0,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """SIGKILL a random worker at a random phase TRIALS times in one run; time each recovery."""
    from elastic.bench.recovery import run_recovery_bench

    if sharding_stage not in (0, 1, 2):
        raise fail(f"--sharding-stage: 0, 1 or 2, got {sharding_stage}")
    try:
        result = run_recovery_bench(workers, trials, seed=seed, replace=replace,
                                    sharding_stage=sharding_stage)
    except (ValueError, ElasticError) as e:
        raise fail(one_line(e)) from None
    table = Table(title=f"recovery from SIGKILL, {workers} workers, {len(result.recoveries)} recoveries")
    for column in ("stage", "median ms", "max ms"):
        table.add_column(column, justify="right")
    for stage in result.stages:
        table.add_row(stage.stage.removesuffix("_s"), f"{stage.median_s * 1e3:.1f}",
                      f"{stage.max_s * 1e3:.1f}")
    console.print(table)
    console.print(f"replacements joined: {result.joins}; work lost per failure (steps): "
                  f"{result.work_lost_steps}; run dir {result.run_dir}")
    save_json(json_path, result.to_json())


@app.command("preemption")
def bench_preemption(
    workers: Annotated[int, typer.Option(help="Workers in each run.")] = 4,
    spares: Annotated[str, typer.Option(
        help="Spare counts to compare, one run each (comma-separated).")] = "0,1",
    trials: Annotated[int, typer.Option(help="SIGTERMs and SIGKILLs per run (one each per trial).")] = 5,
    seed: Annotated[int, typer.Option(help="Seed of the ranks hit.")] = 0,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Time planned departures (SIGTERM) and kills with and without hot spares."""
    from elastic.bench.preemption import Summary, run_preemption_bench

    counts = _numbers("--spares", spares, example="0,1")
    try:
        result = run_preemption_bench(workers, counts, trials, seed=seed)
    except (ValueError, ElasticError) as e:
        raise fail(one_line(e)) from None
    table = Table(title=f"preemption and spares, {workers} workers, {trials} trials per run")
    for column in ("spares", "SIGTERM -> left ms", "SIGTERM -> next step ms", "steps redone",
                   "kill -> full size ms", "steady step ms", "idle spare"):
        table.add_column(column, justify="right")

    def cell(values: list[float]) -> str:
        summary = Summary.of(values)
        return f"{summary.median_s * 1e3:.0f} (max {summary.max_s * 1e3:.0f})" if summary else "-"

    for run in result.runs:
        cost = run.spare_cost
        table.add_row(str(run.spares), cell(run.sigterm_to_gone_s), cell(run.sigterm_to_next_step_s),
                      str(sum(run.steps_redone)), cell(run.kill_to_full_size_s),
                      f"{run.steady_step_s * 1e3:.2f}",
                      f"{cost.cpu_fraction:.1%} CPU, {cost.rss_mb:.0f} MB" if cost else "-")
    console.print(table)
    console.print("medians (max) over the trials; run dirs: "
                  + ", ".join(run.run_dir for run in result.runs))
    save_json(json_path, result.to_json())


@app.command("adapt")
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
        raise fail(one_line(e)) from None
    table = Table(title=f"one of {workers} workers {slow_factor:g}x slower, global batch {batch}")
    for column in ("split", "shares", "steps", "median step ms"):
        table.add_column(column, justify="right")
    table.add_row("even", str(r.shares_even), str(r.even_steps), f"{r.even_median_s * 1e3:.1f}")
    table.add_row("rebalanced", str(r.shares_rebalanced), str(r.rebalanced_steps),
                  f"{r.rebalanced_median_s * 1e3:.1f}")
    console.print(table)
    console.print(f"rebalanced / even step time: {r.ratio:.2f}x ({len(r.rebalances)} rebalance(s)); "
                  f"run dir {r.run_dir}")
    save_json(json_path, r.to_json())


@app.command("overhead")
def bench_overhead(
    workers: Annotated[int, typer.Option(help="World size of both runs.")] = 2,
    model: Annotated[str, typer.Option(
        help="mlp, cnn, lm (a small transformer language model on padded token sequences), "
             "comma-separated; each is benchmarked in turn.")] = "mlp,cnn,lm",
    steps: Annotated[int, typer.Option(help="Steps of each run (the first 8 are warm-up).")] = 40,
    batch: Annotated[int, typer.Option(help="Global batch size (samples or sequences).")] = 256,
    algorithm: Annotated[str, typer.Option(help="Our allreduce algorithm.")] = CollectiveConfig().algorithm,
    overlap: Annotated[bool | None, typer.Option(
        "--overlap/--no-overlap", help="Overlap gradient buckets with backward (default: the "
        "backend's default, off for gloo).")] = None,
    rounds: Annotated[int, typer.Option(
        help="Runs of each, alternating; the ratio is the median of the per-round ratios.")] = 3,
    steps_per_chunk: Annotated[int, typer.Option(
        help="Steps per chunk of the elastic runs (default: the run's default). As many as "
             "--steps: chunks end only at epoch ends (as before issue 22)."),
    ] = FitConfig.model_fields["steps_per_chunk"].default,
    json_path: Annotated[pathlib.Path | None, typer.Option(
        "--json", help="Write results here (a list, one object per model).")] = None,
) -> None:
    """elastic.fit against a plain torch DDP loop: same model, data, batch and world size; where
    the time per step goes in each."""
    from elastic.bench.overhead import MODELS, run_overhead_bench

    names = _names(model)
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        raise fail(f"--model: unknown {', '.join(unknown) or 'none given'}; choose from {', '.join(MODELS)}")
    results = []
    for name in names:
        try:
            results.append(run_overhead_bench(workers, name, steps, batch, algorithm=algorithm,
                                              overlap=overlap, rounds=rounds,
                                              steps_per_chunk=steps_per_chunk))
        except (ValueError, ElasticError) as e:
            raise fail(one_line(e)) from None
    _print_overhead(results, workers, batch, steps_per_chunk, rounds)
    save_json(json_path, [r.to_json() for r in results])


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _print_overhead(results: list[OverheadResult], workers: int, batch: int, steps_per_chunk: int,
                    rounds: int) -> None:
    """One table of every model's breakdown (medians over the rounds), then the per-round ratios."""
    table = Table(title=f"elastic.fit against torch DDP (gloo), {workers} workers, global batch {batch}, "
                        f"chunks of {steps_per_chunk} steps; ms, medians over {rounds} round(s)")
    for column in ("model", "run", "step", "wall / step", "data", "fwd/bwd", "exposed comm",
                   "optimizer", "other", "idle / step", "idle in chunk", "idle at chunk start"):
        table.add_column(column, justify="right")
    for r in results:
        for label, b in (("elastic.fit", r.elastic), ("torch DDP", r.ddp)):
            table.add_row(r.model if label == "elastic.fit" else "", label, _ms(b.step_s),
                          _ms(b.wall_s), _ms(b.data_s), _ms(b.forward_backward_s), _ms(b.comm_s),
                          _ms(b.optimizer_s), _ms(b.other_s), _ms(b.idle_s), _ms(b.idle_in_chunk_s),
                          _ms(b.idle_at_boundary_s))
        table.add_row("", "ratio", f"{r.step_ratio:.2f}x", f"{r.wall_ratio:.2f}x", *[""] * 8,
                      end_section=True)
    console.print(table)
    for r in results:
        line = (f"{r.model}: {r.parameters:,} parameters, algorithm {r.algorithm}, overlap "
                f"{'on' if r.overlap else 'off'}, chunk starts measured at steps {r.chunk_boundaries}")
        if len(r.rounds) > 1:
            line += ("; per-round step ratios " + ", ".join(f"{x['step_ratio']:.2f}x" for x in r.rounds)
                     + " (wall: " + ", ".join(f"{x['wall_ratio']:.2f}x" for x in r.rounds) + ")")
        console.print(line)
    console.print("step: the slowest rank's in-step time; wall: time between step ends; idle: from "
                  "a step's end to the next one's start (both on the last rank); DDP's fwd/bwd "
                  "includes its allreduce, overlapped with backward")


@app.command("scaling")
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

    worker_list = _numbers("--workers", workers, least=1)
    batch_list = _numbers("--batch-sizes", batch_sizes, least=1, example="64,256")
    try:
        r = run_scaling_bench(model, worker_list, batch_list, steps)
    except (ValueError, ElasticError) as e:
        raise fail(one_line(e)) from None
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
    save_json(json_path, r.to_json())
    save(plot, lambda path: plot_scaling(r, str(path)))


@app.command("control")
def bench_control(
    calls: Annotated[int, typer.Option(help="Calls of each command.")] = 20,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Time `elastic status/list/scale/kill/stop` as typed (a process each) on a live run."""
    from elastic.bench.control import run_control_bench

    try:
        r = run_control_bench(calls)
    except (ValueError, RuntimeError, TimeoutError, ElasticError) as e:
        raise fail(one_line(e)) from None
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
    save_json(json_path, r.to_json())


@app.command("checkpoint")
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
        raise fail(str(e)) from None
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
    save_json(json_path, r.to_json())


@app.command("decisions")
def bench_decisions(
    members: Annotated[str, typer.Option(help="World sizes to simulate, comma-separated.")] = "4,64,256,1024",
    steps: Annotated[int, typer.Option(help="Steps of each simulated run (at least 16).")] = 64,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """The controller's own time per step at each world size (simulated members, no Ray)."""
    from elastic.bench.decisions import run_decision_bench

    sizes = _numbers("--members", members, least=1, example="4,16")
    try:
        rows = run_decision_bench(sizes, steps)
    except (ValueError, RuntimeError) as e:
        raise fail(one_line(e)) from None
    table = Table(title=f"controller decision time, {steps} simulated steps with 2 losses, "
                        "their replacements and a resize")
    for column in ("members", "chunks", "generations", "ms per step", "ms per chunk"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r.members), str(r.chunks), str(r.generations),
                      f"{r.decision_ms_per_step:.3f}", f"{r.decision_ms_per_chunk:.3f}")
    console.print(table)
    save_json(json_path, [r.to_json() for r in rows])


@app.command("exact")
def bench_exact(
    models: Annotated[str, typer.Option(help="mlp, cnn or both, comma-separated.")] = "mlp,cnn",
    workers: Annotated[str, typer.Option(help="World sizes, comma-separated.")] = "2,4",
    steps: Annotated[int, typer.Option(help="Steps of each run.")] = 30,
    batch: Annotated[int, typer.Option(help="Global batch size.")] = 256,
    rounds: Annotated[int, typer.Option(
        help="Runs of each mode, alternating; the ratio is the median of the per-round ratios.")] = 1,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Exact mode (batch.exact) against the default: step time and bytes per step."""
    from elastic.bench.exact import run_exact_bench

    worker_list = _numbers("--workers", workers, least=1)
    try:
        r = run_exact_bench(_names(models), worker_list, steps, batch, rounds=rounds)
    except (ValueError, ElasticError) as e:
        raise fail(one_line(e)) from None
    table = Table(title=f"exact mode against the default, global batch {batch} in groups of "
                        f"{r.group_size}")
    for column in ("model", "workers", "default step ms", "exact step ms", "ratio",
                   "default comm ms", "exact comm ms", "default KB/step", "exact KB/step"):
        table.add_column(column, justify="right")
    for row in r.rows:
        table.add_row(row.model, str(row.workers), f"{row.default_step_median_s * 1e3:.1f}",
                      f"{row.exact_step_median_s * 1e3:.1f}", f"{row.ratio:.2f}x",
                      f"{row.default_comm_median_s * 1e3:.1f}",
                      f"{row.exact_comm_median_s * 1e3:.1f}",
                      f"{row.default_bytes_per_step / 1024:,.0f}",
                      f"{row.exact_bytes_per_step / 1024:,.0f}")
    console.print(table)
    for model, same in r.bit_identical.items():
        if same is None:
            console.print(f"{model}: one world size ({workers}): weight bits not compared "
                          "(give --workers two or more sizes)")
            continue
        console.print(f"{model}: exact runs at workers {workers} ended with "
                      f"{'the same weight bits' if same else 'DIFFERENT weights (a bug)'}")
    save_json(json_path, r.to_json())


@app.command("data")
def bench_data(
    workers: Annotated[int, typer.Option(help="World size.")] = 2,
    loader_workers: Annotated[int, typer.Option(help="Loader processes per worker (k).")] = 2,
    image_size: Annotated[int, typer.Option(
        help="Side of the PNG images decoded per sample: sets the data cost.")] = 96,
    steps: Annotated[int, typer.Option(help="Steps of each run (the first third is warm-up).")] = 60,
    batch: Annotated[int, typer.Option(help="Global batch size.")] = 64,
    rounds: Annotated[int, typer.Option(
        help="Runs of each, alternating in a rotated order; medians are reported.")] = 3,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Decoding images: step time with and without loader processes, against the bound
    max(compute, data / k) and DDP with DataLoader(num_workers=0) and (num_workers=k)."""
    from elastic.bench.data import run_data_bench

    try:
        r = run_data_bench(workers, loader_workers, batch, image_size, steps, rounds=rounds)
    except (ValueError, ElasticError) as e:
        raise fail(one_line(e)) from None
    console.print(f"one rank's share ({batch // workers} images of {image_size}px) on one thread: "
                  f"data {r.data_s * 1e3:.1f} ms, compute {r.compute_s * 1e3:.1f} ms; bound "
                  f"max(compute, data/{loader_workers}) = {r.bound_s * 1e3:.1f} ms, "
                  f"compute + data = {r.serial_s * 1e3:.1f} ms")
    table = Table(title=f"{workers} workers, global batch {batch}, {loader_workers} loader "
                        f"processes per worker, medians of {rounds} rounds")
    for column in ("", "median step ms", "wall ms / step", "vs bound"):
        table.add_column(column, justify="right")
    for name, step_s, wall_s in r.rows():
        table.add_row(name, f"{step_s * 1e3:.1f}", f"{wall_s * 1e3:.1f}", f"{step_s / r.bound_s:.2f}x")
    console.print(table)
    console.print(f"elastic / DDP, with loaders: {r.ddp_ratio:.2f}x (step), "
                  f"{r.loaders_wall_s / r.ddp_wall_s:.2f}x (wall); without: "
                  f"{r.ddp_no_loaders_ratio:.2f}x (step), "
                  f"{r.no_loaders_wall_s / r.ddp_no_loaders_wall_s:.2f}x (wall)")
    save_json(json_path, r.to_json())


@app.command("gpu")
def bench_gpu(
    models: Annotated[str, typer.Option(help="Comma-separated: resnet50, gpt2.")] = "resnet50,gpt2",
    shared: Annotated[int, typer.Option(
        help="Also run this many workers sharing the GPU (backend gloo); 0: only 1 worker.")] = 4,
    out_dir: Annotated[pathlib.Path, typer.Option(
        help="Where gpu_throughput.json goes (written after each measurement).")] = pathlib.Path("bench-out"),
    device: Annotated[str, typer.Option(
        help="'cuda', or 'cpu' with --size tiny: a rehearsal of the bench on CPU workers.")] = "cuda",
    size: Annotated[str, typer.Option(
        help="'full' (ResNet-50 at 224 px, GPT-2 124M) or 'tiny' (the same code, seconds on a CPU).")
    ] = "full",
) -> None:
    """Training throughput on one GPU: elastic.fit with 1 worker (and several sharing the GPU)
    against a plain PyTorch loop, same model, data, batch, bf16 autocast and loaders. Needs
    CUDA (and torchvision, transformers)."""
    import torch

    from elastic.bench.gpu import MODELS, SIZES, missing, run, table

    if device not in ("cuda", "cpu"):
        raise fail(f"--device: 'cuda' or 'cpu', got {device!r}")
    if size not in SIZES:
        raise fail(f"--size: one of {', '.join(SIZES)}, got {size!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise fail(f"elastic bench gpu needs a CUDA device; torch {torch.__version__} sees none "
                   "(--device cpu --size tiny rehearses it on the CPU)")
    if device == "cpu" and size != "tiny":
        raise fail("--device cpu runs only at --size tiny (a full-size run on a CPU takes hours)")
    if shared == 1 or shared < 0:
        raise fail(f"--shared: 0 (none) or 2 and more workers sharing the GPU, got {shared}")
    chosen = tuple(_names(models))
    unknown = sorted(set(chosen) - set(MODELS))
    if unknown or not chosen:
        raise fail(f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from "
                   f"{', '.join(MODELS)}")
    reasons = [why for why in map(missing, chosen) if why]
    if reasons:
        raise fail("--models: " + "; ".join(reasons))
    small = [f"{m} (batch {SIZES[size][m].batch})" for m in chosen if shared > SIZES[size][m].batch]
    if small:
        raise fail(f"--shared {shared}: more workers than samples per step of {', '.join(small)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    run(str(out_dir), chosen, shared, device, size)
    table(str(out_dir / "gpu_throughput.json"))


@app.command("drift")
def bench_drift(
    steps: Annotated[str, typer.Option(help="Run lengths, comma-separated.")] = "12,120,360",
    workers: Annotated[int, typer.Option(help="World size.")] = 2,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """How far the default mode's weights drift from one plain process as runs get longer,
    with no fault (a BatchNorm CNN; exact mode does not drift)."""
    from dataclasses import asdict

    from elastic.bench.drift import run_drift

    lengths = _numbers("--steps", steps, least=1, example="12,120")
    points = run_drift(lengths, workers)
    table = Table(title=f"default mode on {workers} workers against one plain process (no fault)")
    for column in ("steps", "largest weight difference"):
        table.add_column(column, justify="right")
    for p in points:
        table.add_row(str(p.steps), f"{p.max_weight_difference:.2e}")
    console.print(table)
    save_json(json_path, {"workers": workers, "points": [asdict(p) for p in points]})


@app.command("step")
def bench_step(
    depths: Annotated[str, typer.Option(
        help="Convolution + BatchNorm blocks of the CNN, comma-separated.")] = "4,16,52",
    device: Annotated[str, typer.Option(help="'cpu' or 'cuda'.")] = "cpu",
    width: Annotated[int, typer.Option(help="Channels of each block.")] = 8,
    batch: Annotated[int, typer.Option(help="Samples per step.")] = 8,
    image_size: Annotated[int, typer.Option(help="Image side in pixels.")] = 8,
    steps: Annotated[int, typer.Option(help="Steps timed per runner (after 5 warm-up).")] = 30,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """Elastic's step at one worker against a plain PyTorch step in one process: time per
    step and tensor operations per step (kernel launches on a GPU) as the model deepens."""
    from dataclasses import asdict

    import torch

    from elastic.bench.step import run_step_bench

    levels = _numbers("--depths", depths, example="4,16,52")
    if min(width, batch, image_size, steps) < 1:
        raise fail("--width, --batch, --image-size and --steps: 1 or more")
    if device not in ("cpu", "cuda"):
        raise fail(f"--device: 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise fail("--device cuda: torch sees no CUDA device here; use --device cpu")
    rows = run_step_bench(levels, device, width, batch, image_size, steps)
    table = Table(title=f"one step on {device}: elastic at one worker against plain PyTorch")
    for column in ("blocks", "runner", "ms / step", "vs plain", "operations", "beyond plain"):
        table.add_column(column, justify="left" if column == "runner" else "right")
    for r in rows:
        table.add_row(str(r.depth), r.runner, f"{r.ms_per_step:.2f}", f"{r.vs_plain:.2f}x",
                      str(r.operations), str(r.beyond_plain))
    console.print(table)
    save_json(json_path, {"device": device, "width": width, "batch": batch,
                          "image_size": image_size, "steps": steps,
                          "rows": [asdict(r) for r in rows]})


@app.command("memory")
def bench_memory(
    model: Annotated[str, typer.Option(help="The model: 'gpt' (a 55M-parameter decoder).")] = "gpt",
    workers: Annotated[int, typer.Option(help="World size.")] = 4,
    stages: Annotated[str, typer.Option(help="Sharding stages, comma-separated.")] = "0,1,2",
    replicas: Annotated[int, typer.Option(help="Owners per parameter when sharded.")] = 2,
    steps: Annotated[int, typer.Option(help="Steps per stage (the first is left out of the "
                                             "median).")] = 5,
    json_path: Annotated[pathlib.Path | None, typer.Option("--json", help="Write results here.")] = None,
) -> None:
    """What each worker holds (optimizer state, gradients, parameters, peak memory) with the
    optimizer state whole (stage 0), sharded (stage 1), or sharded with the summed gradients
    (stage 2), and the median step time."""
    from dataclasses import asdict

    from elastic.bench.memory import run_memory

    if model != "gpt":
        raise fail(f"--model: only 'gpt' is built in, got {model!r}")
    wanted = sorted(set(_numbers("--stages", stages, example="0,1,2")))
    if any(s not in (0, 1, 2) for s in wanted):
        raise fail(f"--stages: 0, 1 or 2, got {stages!r}")
    if not 1 <= replicas <= workers:
        raise fail(f"--replicas: between 1 and --workers ({workers}), got {replicas}")
    results = run_memory(wanted, workers, replicas, steps)
    base = next((r for r in results if r.stage == 0), None)
    mb = 1 << 20
    table = Table(title=f"{results[0].parameters / 1e6:.1f}M-parameter GPT, AdamW, "
                        f"{workers} workers (largest rank)")
    for column in ("stage", "replicas", "optimizer state MB", "vs stage 0", "gradients MB",
                   "parameters MB", "peak RSS MB", "median step s", "vs stage 0 "):
        table.add_column(column, justify="right")
    for r in results:
        state = r.largest("optimizer_state_bytes")
        table.add_row(
            str(r.stage), str(r.replicas or "-"), f"{state / mb:.0f}",
            f"{state / base.largest('optimizer_state_bytes'):.2f}" if base else "-",
            f"{r.largest('gradient_bytes') / mb:.0f}", f"{r.largest('parameter_bytes') / mb:.0f}",
            f"{r.largest('peak_rss_bytes') / mb:.0f}", f"{r.median_step_s:.2f}",
            f"{r.median_step_s / base.median_step_s:.2f}" if base and base.median_step_s else "-")
    console.print(table)
    save_json(json_path, {"model": model, "workers": workers,
                          "results": [asdict(r) for r in results]})
