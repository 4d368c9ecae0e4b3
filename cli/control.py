"""Commands on runs by name, live or ended: `list`, `logs`, `status`, `scale`, `kill`, `drain`,
`stop`.

Each one calls the Python API (`elastic.runs`, `elastic.status`, ...) and prints its answer.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

import elastic
from cli.output import console, fail, one_line, to_json
from cli.render import log_line
from elastic.errors import ElasticError
from elastic.events import parse


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


def logs(name: Annotated[str, typer.Argument(help="Run name.")]) -> None:
    """Print a run's events so far (live or ended)."""
    try:
        events = elastic.events(name)
    except ElasticError as e:
        raise fail(one_line(e)) from None
    for record in events:
        # Plain text, never wrapped: one event per line, as `grep` wants it.
        console.print(log_line(parse(record)), markup=False, highlight=False, soft_wrap=True)


def status(
    name: Annotated[str, typer.Argument(help="Run name.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show a run's state, step and workers; for an ended run, how it ended."""
    try:
        info = elastic.status(name)
    except ElasticError as e:
        raise fail(one_line(e)) from None
    if as_json:
        console.print_json(to_json(info))
        return
    line = (f"run {info['name']}: {info['state']}, step {info['step']}/{info['total_steps']}, "
            f"last loss {_loss(info.get('last_loss'))}, started {_when(info.get('started_at'))}")
    if info.get("ended_at"):
        line += f", ended {_when(info['ended_at'])}"
    console.print(line + f", {info['failures']} failures; run dir {info['run_dir']}")
    resumed = info.get("resumed_from")  # absent from the records of older runs
    if resumed:
        console.print(f"resumed from step {resumed['step']}"
                      + (f" of run {resumed['run']}" if resumed.get("run") else "")
                      + f" ({resumed['path']})")
    if info.get("error_type"):
        console.print(f"error: {info['error_type']}: {info['error_message']}")
    if info["state"] == "lost":
        console.print("its controller no longer answers and recorded no end: the process or the Ray "
                      "cluster stopped before the run could finish")
    joining = info.get("joining_workers", 0)  # absent from the records of older runs
    if not info["workers"] and not joining:
        return
    line = (f"{info['world_size']} workers (target {info['target_workers']}), "
            f"generation {info['generation']}")
    if joining:
        line += f", {joining} joining"  # admitted, in no generation yet: no rank
    spares = info.get("spare_workers", 0)  # absent from the records of older runs
    if spares:
        line += f", {spares} spare{'s' if spares > 1 else ''} ready"
    if info.get("preemptions"):
        line += f", {info['preemptions']} preempted"
    console.print(line)
    if not info["workers"]:
        return
    table = Table()
    for column in ("rank", "worker", "pid", "node"):
        table.add_column(column)
    for w in info["workers"]:
        table.add_row(str(w["rank"]), str(w["worker_id"]), str(w["pid"]), w["node_id"][:12])
    console.print(table)


def scale(name: Annotated[str, typer.Argument(help="Run name.")],
          num_workers: Annotated[int, typer.Argument(help="New number of workers.")]) -> None:
    """Grow or shrink a live run at its next step boundary."""
    try:
        elastic.scale(name, num_workers)
    except ElasticError as e:
        raise fail(one_line(e)) from None
    console.print(f"run {name}: scaling to {num_workers} workers at the next step boundary")


def kill(name: Annotated[str, typer.Argument(help="Run name.")],
         rank: Annotated[int, typer.Option(help="Rank of the worker to kill.")]) -> None:
    """Kill one worker of a live run (the run recovers)."""
    try:
        elastic.kill(name, rank)
    except ElasticError as e:
        raise fail(one_line(e)) from None
    console.print(f"run {name}: killed rank {rank}")


def drain(
    name: Annotated[str, typer.Argument(help="Run name.")],
    rank: Annotated[int | None, typer.Option(help="Rank of the worker that leaves.")] = None,
    node: Annotated[str | None, typer.Option(
        help="Ray node id (or a prefix, as `elastic status` shows): every worker on it leaves.")] = None,
    deadline: Annotated[float | None, typer.Option(
        help="Seconds to leave in; a worker still training then is killed and the run recovers.")] = None,
) -> None:
    """Let a worker (or a node's workers) leave a live run at the next step boundary: no step
    redone, a replacement starts."""
    try:
        ids = elastic.drain(name, rank=rank, node=node, deadline=deadline)
    except ElasticError as e:
        raise fail(one_line(e)) from None
    who = f"rank {rank}" if rank is not None else f"the workers on node {node}"
    console.print(f"run {name}: {who} (worker(s) {', '.join(map(str, ids)) or 'none new'}) "
                  "leave at the next step boundary")


def stop(name: Annotated[str, typer.Argument(help="Run name.")]) -> None:
    """Stop a live run gracefully at its next step boundary."""
    try:
        elastic.stop(name)
    except ElasticError as e:
        raise fail(one_line(e)) from None
    console.print(f"run {name}: stopping at the next step boundary")
