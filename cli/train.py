"""Training commands: `run` (foreground), `start` (detached) and `demo`; `run` and `start`
share one declared option set (`_training_options`) and one way to build the configuration
(`_prepare`: config file, then command-line overrides, then the target).
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re
import signal
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Annotated, Any, get_type_hints

import pydantic
import typer
from rich.table import Table

import elastic
from cli.output import console, fail, one_line
from cli.render import describe
from elastic.api import recorded_launch, run_dir_of
from elastic.errors import ElasticError
from elastic.events import Evaluate, Recovered, parse
from elastic.progress import resolve

# Command-line option -> dotted FitConfig field; `run` and `start` share them.
_OPTION_FIELDS = {
    "workers": "scaling.num_workers", "min_workers": "scaling.min_workers",
    "max_workers": "scaling.max_workers", "spares": "scaling.spares", "gpu": "scaling.use_gpu",
    "gpus_per_worker": "scaling.gpus_per_worker",
    "global_batch": "batch.global_batch_size",
    "max_micro_batch": "batch.max_micro_batch", "batch_policy": "batch.policy",
    "epochs": "epochs", "max_steps": "max_steps",
    "seed": "seed", "name": "name", "run_dir": "run_dir", "backend": "collective.backend",
    "algorithm": "collective.algorithm", "loader_workers": "data.loader_workers",
    "tensorboard": "logging.tensorboard", "csv": "logging.csv",
    "sharding_stage": "sharding.stage", "shard_replicas": "sharding.replicas",
    "checkpoint": "checkpoint.path", "keep_last": "checkpoint.keep_last",
}

# Dotted FitConfig field -> the option that sets it, for naming the option in errors.
_FLAGS = {dotted: "--" + option.replace("_", "-") for option, dotted in _OPTION_FIELDS.items()}
_FLAGS.update({"chaos": "--kill-at", "ledger": "--ledger", "batch.exact": "--exact",
               "checkpoint.every_steps": "--checkpoint-every",
               "checkpoint.every_seconds": "--checkpoint-every"})
_NO_END = "set epochs or max_steps"  # the start of FitConfig's message when neither is set


def _overrides(options: dict[str, Any]) -> dict[str, object]:
    return {dotted: options[option] for option, dotted in _OPTION_FIELDS.items()}


def _prepare(options: dict[str, Any]) -> tuple[elastic.FitConfig, elastic.TrainJob]:
    """The target, then the config file, then command-line overrides; bad input exits 2 with
    one line (a bad target or file) or every problem of the configuration, each naming the
    option that sets it."""
    tree: dict[str, Any] | None = None
    try:
        job = elastic.load_target(options["target"])
        tree = _config_tree(options)
        fit_config = elastic.FitConfig.for_job(job, **tree)  # with what the job implies
    except Exception as e:
        if options["debug"]:
            raise
        # Only an error of the FitConfig built here names options; one raised while the
        # target was imported (its own FitConfig, say) is the target's, told as it is.
        if (tree is None or not isinstance(e, pydantic.ValidationError)
                or e.title != elastic.FitConfig.__name__):
            raise fail(one_line(e)) from None
        problems = _config_problems(e, tree, job.settings)
        if len(problems) == 1:
            raise fail(f"invalid configuration: {problems[0]}") from None
        raise fail(f"invalid configuration ({len(problems)} problems):\n"
                   + "\n".join(f"  {p}" for p in problems)) from None
    if options["address"]:
        os.environ["RAY_ADDRESS"] = options["address"]
    return fit_config, job


def _config_tree(options: dict[str, Any]) -> dict[str, Any]:
    """The FitConfig fields as a nested dict: the config file, then the command line over it."""
    config: pathlib.Path | None = options["config"]
    tree = _load_config_file(config) if config else {}
    for dotted, value in _overrides(options).items():
        _set(tree, dotted, value)
    every = options["checkpoint_every"]
    if every is not None:
        _set(tree, *_checkpoint_every(every))
    path = options["checkpoint"]
    if path is not None and "://" not in path:  # `elastic resume` may run from elsewhere
        _set(tree, "checkpoint.path", os.path.abspath(path))
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
    return tree


def _config_problems(error: pydantic.ValidationError, tree: dict[str, Any],
                     implied: Mapping[str, Any]) -> list[str]:
    """Every problem of `error`, one line each, naming the command-line option that fixes it
    (a required setting left out: the option, or the field of a config file); `implied`: the
    job's settings (`TrainJob.settings`: a Lightning module's epochs, say)."""
    # FitConfig says that the run has no end only once the rest is valid: say it with the rest.
    no_end = all(tree.get(end) is None and implied.get(end) is None
                 for end in ("epochs", "max_steps"))
    problems: list[str] = []
    for item in error.errors():
        loc = tuple(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            problems += [_missing(".".join(loc + rest)) for rest in _required_below(loc)]
        elif not (no_end and not loc and message.startswith(_NO_END)):
            where = ".".join(loc)
            at = next((_FLAGS[p] for p in reversed(_prefixes(loc)) if p in _FLAGS), None)
            flags = [f for f in _flags_named(loc, message) if f != at]
            if at is not None and at != "--" + where.replace("_", "-"):
                at += f" ({where})"
            problems.append((f"{at}: " if at else f"{where}: " if where else "") + message
                            + (f" (command line: {', '.join(flags)})" if flags else ""))
    if no_end:
        problems.append("--epochs or --max-steps is required (or epochs or max_steps in "
                        "--config FILE)")
    return problems


def _missing(dotted: str) -> str:
    flag = _FLAGS.get(dotted)
    if flag is None:
        return f"{dotted} is required in --config FILE"
    return f"{flag} is required (or {dotted} in --config FILE)"


def _required_below(loc: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The required fields under a missing FitConfig field at `loc`, relative to it: the
    required leaves of a missing section (`scaling` -> `num_workers`), else the field itself."""
    annotation: Any = elastic.FitConfig
    for key in loc:
        field = annotation.model_fields.get(key) if _is_model(annotation) else None
        if field is None:
            return [()]
        annotation = field.annotation
    return _required_leaves(annotation) or [()]


def _required_leaves(annotation: Any) -> list[tuple[str, ...]]:
    if not _is_model(annotation):
        return [()]
    return [(name, *rest) for name, field in annotation.model_fields.items() if field.is_required()
            for rest in _required_leaves(field.annotation)]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)


def _flags_named(loc: tuple[str, ...], text: str) -> list[str]:
    """The options that set the fields `text` names, in the order it names them: dotted from
    the top (`scaling.use_gpu`), or relative to the section at `loc` (`min_workers`)."""
    found: dict[str, int] = {}
    for dotted, flag in _FLAGS.items():
        names = [dotted] + [dotted[len(p) + 1:] for p in _prefixes(loc) if dotted.startswith(p + ".")]
        for name in names:
            match = re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text)
            if match:
                found[flag] = min(found.get(flag, match.start()), match.start())
    return sorted(found, key=found.__getitem__)


def _prefixes(loc: tuple[str, ...]) -> list[str]:
    return [".".join(loc[:n]) for n in range(1, len(loc) + 1)]


def _training_options(
    target: Annotated[str, typer.Argument(help="path/to/file.py:job or package.module:job")],
    workers: Annotated[int | None, typer.Option(help="Workers to start with.")] = None,
    min_workers: Annotated[int | None, typer.Option(help="Fewest workers to continue with.")] = None,
    max_workers: Annotated[int | None, typer.Option(help="Most workers to grow to.")] = None,
    spares: Annotated[int | None, typer.Option(
        help="Hot spares: started workers that take a lost or departing worker's place at "
        "once (scaling.spares; on top of the world size).")] = None,
    gpu: Annotated[bool | None, typer.Option(
        "--gpu/--no-gpu", help="Give each worker a GPU (scaling.use_gpu): --backend nccl for "
        "one GPU per worker (auto picks it when cupy is installed), gloo to reduce over host "
        "memory. Default: the config file's, else no GPU.")] = None,
    gpus_per_worker: Annotated[float | None, typer.Option(
        help="GPUs per worker with --gpu (scaling.gpus_per_worker; 0.25: four workers share a "
        "GPU, reducing over host memory: backend gloo, which auto picks).")] = None,
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
    backend: Annotated[str | None, typer.Option(
        help="auto (nccl for GPU workers with a GPU each when cupy is installed, else gloo), "
        "gloo or nccl.")] = None,
    algorithm: Annotated[str | None, typer.Option(
        help="auto (default), direct, hierarchical, ring, tree, halving_doubling, native.")] = None,
    loader_workers: Annotated[int | None, typer.Option(
        help="Loader processes per worker reading the next steps' samples ahead.")] = None,
    tensorboard: Annotated[str | None, typer.Option(
        help="TensorBoard log directory for the committed steps and evaluations (needs "
        "pip install 'elastic\\[loggers]').")] = None,
    csv: Annotated[str | None, typer.Option(
        help="CSV file of the committed steps and evaluations, one row each.")] = None,
    sharding_stage: Annotated[int | None, typer.Option(
        help="0 (default): every worker holds the whole optimizer state; 1: each holds the "
        "state of the parameters it owns; 2: and only their summed gradients "
        "(sharding.stage).")] = None,
    shard_replicas: Annotated[int | None, typer.Option(
        help="Workers owning each parameter's optimizer state with --sharding-stage 1 or 2 "
        "(default 2; any replicas - 1 may be lost).")] = None,
    checkpoint: Annotated[str | None, typer.Option(
        help="Checkpoint root (a folder or an fsspec URL): the run resumes from its newest "
        "checkpoint there, and `elastic resume NAME` restarts it (checkpoint.path).")] = None,
    checkpoint_every: Annotated[str | None, typer.Option(
        help="Write a checkpoint every N steps, or every 30s, 10m or 2h "
        "(checkpoint.every_steps or every_seconds; default 30m).")] = None,
    keep_last: Annotated[int | None, typer.Option(
        help="Checkpoints kept (checkpoint.keep_last, default 3).")] = None,
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


_SECONDS = {"s": 1, "m": 60, "h": 3600}


def _checkpoint_every(value: str) -> tuple[str, float | int]:
    """`--checkpoint-every`: N (steps) or a duration (30s, 10m, 2h) -> (dotted field, value).

    Raises:
        ValueError: neither.
    """
    text = value.strip().lower()
    if text.isdigit():
        return "checkpoint.every_steps", int(text)
    try:
        if text[-1:] in _SECONDS:
            return "checkpoint.every_seconds", float(text[:-1]) * _SECONDS[text[-1]]
    except ValueError:
        pass
    raise ValueError(f"--checkpoint-every: a number of steps (500) or a duration (30s, 10m, "
                     f"2h), got {value!r}")


def _load_config_file(path: pathlib.Path) -> dict:
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        return tomllib.loads(text)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        tree = yaml.safe_load(text) or {}
        if not isinstance(tree, dict):
            raise ValueError(f"--config {path}: its top level must be settings (name: value), "
                             f"not a {type(tree).__name__}")
        return tree
    raise ValueError(f"--config {path}: use a .toml or .yaml file")


def _set(tree: dict, dotted: str, value: object) -> None:
    if value is None:
        return
    *parents, leaf = dotted.split(".")
    for i, key in enumerate(parents):
        if tree.get(key) is None:  # absent, or a section a YAML file left empty (`scaling:`)
            tree[key] = {}
        elif not isinstance(tree[key], dict):
            raise ValueError(f"{'.'.join(parents[:i + 1])} in --config FILE must be a section "
                             f"of settings, not {tree[key]!r}")
        tree = tree[key]
    tree[leaf] = value


def _name(config: elastic.FitConfig) -> str:
    """The run's name: `name`, else a new one (never one an earlier run may have had: a
    container's entrypoint has the same process id at every start)."""
    return config.name or f"run-{uuid.uuid4().hex[:8]}"


@_training_command
def run(options: dict[str, Any]) -> None:
    """Train TARGET in the foreground, showing its progress and its events as they happen (a
    progress bar on a terminal, plain lines otherwise)."""
    fit_config, job = _prepare(options)
    run_name = _name(fit_config)
    # `fit` shows the progress; 'auto' means lines here where `fit` alone would print nothing.
    progress = resolve(fit_config.logging.progress, console.is_terminal, otherwise="lines")
    shown = fit_config.logging.model_copy(update={"progress": progress or "off"})
    fit_config = fit_config.model_copy(update={"name": run_name, "logging": shown})
    directory = run_dir_of(fit_config.run_dir, run_name)
    console.print(f"run [bold]{run_name}[/bold]: {fit_config.scaling.num_workers} workers, "
                  f"global batch {fit_config.batch.global_batch_size}, run dir {directory}")
    try:
        with recorded_launch(run_name, directory, options["target"]):  # what `resume` restarts
            result = elastic.fit(job, fit_config)
    except ElasticError as e:
        if options["debug"]:
            raise
        raise fail(f"{type(e).__name__}: {one_line(e)}") from None
    except KeyboardInterrupt as e:  # Ctrl-C: `fit` stopped the run (or abandoned it on a second)
        _ignore_ctrl_c()
        if e.args:
            console.print(str(e), markup=False, highlight=False)
        raise  # typer exits with code 130
    except SystemExit:  # SIGTERM: `fit` stopped the run and said so; exit code 143
        _ignore_ctrl_c()
        raise
    _print_summary(result)


def _ignore_ctrl_c() -> None:
    """The run has ended and this process exits: one more Ctrl-C or SIGTERM would only break
    off Ray's shutdown at exit (a traceback, and a local cluster's processes left behind)."""
    if threading.current_thread() is threading.main_thread():  # signal handlers are set there
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


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
    name = _name(fit_config)
    fit_config = fit_config.model_copy(update={"name": name})
    try:
        with recorded_launch(name, run_dir_of(fit_config.run_dir, name), options["target"]):
            run_name = elastic.start(job, fit_config)
    except ElasticError as e:
        if options["debug"]:
            raise
        raise fail(one_line(e)) from None
    console.print(f"started run {run_name}; follow it with `elastic status {run_name}`")


def resume(
    name: Annotated[str, typer.Argument(help="Run name.")],
    workers: Annotated[int | None, typer.Option(
        min=1, help="Another world size (the run's bounds widen to take it; the math of a "
        "step stays).")] = None,
    address: Annotated[str | None, typer.Option(
        help="Ray cluster address (default: RAY_ADDRESS; attached, a local cluster is started "
        "if there is none).")] = None,
    detach: Annotated[bool, typer.Option(
        help="Start it detached on a running cluster and return at once.")] = False,
    max_steps: Annotated[int | None, typer.Option(
        min=1, help="Train to this step instead (max_steps, over the run's epochs; to train "
        "longer).")] = None,
    force: Annotated[bool, typer.Option(
        help="Resume although the target's file changed since the run started, or its "
             "record says it runs on a Ray cluster this process cannot reach (gone).")] = False,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """Start a lost, failed or stopped run again from its newest checkpoint, with the target
    and configuration it started with."""
    if address:
        os.environ["RAY_ADDRESS"] = address
    progress = "off" if detach else (
        resolve("auto", console.is_terminal, otherwise="lines") or "off")
    console.print(f"resuming run [bold]{name}[/bold] from its newest checkpoint")
    try:
        overrides: dict[str, Any] = {"logging.progress": progress}
        if max_steps is not None:
            overrides["max_steps"] = max_steps
        outcome = elastic.resume(name, num_workers=workers, detach=detach, force=force,
                                 overrides=overrides)
    except ElasticError as e:
        if debug:
            raise
        raise fail(f"{type(e).__name__}: {one_line(e)}") from None
    except KeyboardInterrupt as e:
        _ignore_ctrl_c()
        if e.args:
            console.print(str(e), markup=False, highlight=False)
        raise
    except SystemExit:
        _ignore_ctrl_c()
        raise
    if isinstance(outcome, str):
        console.print(f"resumed run {outcome} detached; follow it with `elastic status {outcome}`")
        return
    _print_summary(outcome)


def demo(
    workers: Annotated[int, typer.Option(help="Workers.")] = 4,
    epochs: Annotated[int, typer.Option(help="Epochs over the digits data set.")] = 30,
    run_dir: Annotated[str | None, typer.Option(help="Where both runs go (default: temp).")] = None,
) -> None:
    """Digits MLP on 4 workers with one killed part-way, next to an uninterrupted run."""
    from elastic.demo import run_demo

    if workers < 2:
        raise fail("--workers must be at least 2: the demo kills rank 1 and the others go on")
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
    console.print(f"largest weight difference against the uninterrupted run: "
                  f"{result.max_weight_difference():.2e} (float32; the sums of a step are added "
                  "in another order when the world size changes, nothing else differs)")
    console.print(f"run dirs: {result.elastic.run_dir}, {result.uninterrupted.run_dir}; "
                  f"plots: elastic report {result.elastic.run_dir}")
