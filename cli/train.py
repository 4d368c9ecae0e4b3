"""Training commands: `run` (foreground), `start` (detached) and `demo`; `run` and `start`
share one declared option set (`_training_options`) and one way to build the configuration
(`_prepare`: config file, then command-line overrides, then the target).
"""

from __future__ import annotations

import inspect
import os
import pathlib
from collections.abc import Callable
from typing import Annotated, Any, get_type_hints

import typer
from rich.table import Table

import elastic
from cli.output import console, fail, one_line
from cli.render import describe
from elastic.errors import ElasticError
from elastic.events import Evaluate, Recovered, parse
from elastic.progress import resolve

# Command-line option -> dotted FitConfig field; `run` and `start` share them.
_OPTION_FIELDS = {
    "workers": "scaling.num_workers", "min_workers": "scaling.min_workers",
    "max_workers": "scaling.max_workers", "global_batch": "batch.global_batch_size",
    "max_micro_batch": "batch.max_micro_batch", "batch_policy": "batch.policy",
    "epochs": "epochs", "max_steps": "max_steps",
    "seed": "seed", "name": "name", "run_dir": "run_dir", "backend": "collective.backend",
    "algorithm": "collective.algorithm", "loader_workers": "data.loader_workers",
    "tensorboard": "logging.tensorboard", "csv": "logging.csv",
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
        if options["exact"]:  # a flag: only ever turns it on over a config file
            _set(tree, "batch.exact", True)
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
        raise fail(one_line(e)) from None
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
    algorithm: Annotated[str | None, typer.Option(
        help="auto (default), direct, hierarchical, ring, tree, halving_doubling, native.")] = None,
    loader_workers: Annotated[int | None, typer.Option(
        help="Loader processes per worker reading the next steps' samples ahead.")] = None,
    tensorboard: Annotated[str | None, typer.Option(
        help="TensorBoard log directory for the committed steps and evaluations (needs "
        "pip install 'elastic[loggers]').")] = None,
    csv: Annotated[str | None, typer.Option(
        help="CSV file of the committed steps and evaluations, one row each.")] = None,
    kill_at: Annotated[list[str] | None, typer.Option(help="Chaos: kill RANK at STEP (STEP:RANK).")] = None,
    ledger: Annotated[bool, typer.Option(help="Record the indices of every step.")] = False,
    exact: Annotated[bool, typer.Option(
        help="Exact mode: the same weight bits for any failures, resizes and world size.")] = False,
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


@_training_command
def run(options: dict[str, Any]) -> None:
    """Train TARGET in the foreground, showing its progress and its events as they happen (a
    progress bar on a terminal, plain lines otherwise)."""
    fit_config, job = _prepare(options)
    run_name = fit_config.name or f"run-{os.getpid()}"
    # `fit` shows the progress; 'auto' means lines here where `fit` alone would print nothing.
    progress = resolve(fit_config.logging.progress, console.is_terminal, otherwise="lines")
    shown = fit_config.logging.model_copy(update={"progress": progress or "off"})
    fit_config = fit_config.model_copy(update={"name": run_name, "logging": shown})
    directory = pathlib.Path(fit_config.run_dir or os.path.join("runs", run_name))
    console.print(f"run [bold]{run_name}[/bold]: {fit_config.scaling.num_workers} workers, "
                  f"global batch {fit_config.batch.global_batch_size}, run dir {directory}")
    try:
        result = elastic.fit(job, fit_config)
    except ElasticError as e:
        if options["debug"]:
            raise
        raise fail(f"{type(e).__name__}: {one_line(e)}") from None
    _print_summary(result)


def _print_summary(result: elastic.FitResult) -> None:
    """The table `run` ends with: steps, loss, world size, recoveries, evaluation."""
    summary = Table(title=f"run {result.name}")
    summary.add_column("")
    summary.add_column("", justify="right")
    last = result.metrics[-1] if result.metrics else {}
    for key, value in (
        ("steps", result.steps), ("samples", result.samples),
        ("final loss", f"{last.get('loss', float('nan')):.4f}"),
        ("world size at the end", last.get("world_size", "-")),
        ("recoveries", _recoveries(result.events)),
        ("stopped early", "yes" if result.stopped else "no"),
        *((k, f"{v:.4f}") for k, v in result.evaluation.items()),
    ):
        summary.add_row(str(key), str(value))
    console.print(summary)


def _recoveries(records: list[dict[str, Any]]) -> int:
    """How many recoveries completed, among a run's event records."""
    return sum(isinstance(parse(r), Recovered) for r in records)


@_training_command
def start(options: dict[str, Any]) -> None:
    """Start TARGET as a detached run on a running Ray cluster and return at once."""
    fit_config, job = _prepare(options)
    try:
        run_name = elastic.start(job, fit_config)
    except ElasticError as e:
        if options["debug"]:
            raise
        raise fail(one_line(e)) from None
    console.print(f"started run {run_name}; follow it with `elastic status {run_name}`")


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
    for event in map(parse, result.elastic.events):
        line = describe(event)
        if line and not isinstance(event, Evaluate):
            console.print(f"[cyan]event[/cyan] {line}")
    table = Table(title="digits, final accuracy on the data set")
    for column in ("run", "steps", "world sizes", "recoveries", "accuracy"):
        table.add_column(column, justify="right")
    for label, r in (("with a worker killed", result.elastic), ("uninterrupted", result.uninterrupted)):
        sizes = sorted({m["world_size"] for m in r.metrics}, reverse=True)
        table.add_row(label, str(r.steps), ",".join(map(str, sizes)),
                      str(_recoveries(r.events)),
                      f"{r.evaluation.get('accuracy', float('nan')):.4f}")
    console.print(table)
    console.print(f"run dirs: {result.elastic.run_dir}, {result.uninterrupted.run_dir}; "
                  f"plots: elastic report {result.elastic.run_dir}")
