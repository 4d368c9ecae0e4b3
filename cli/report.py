"""`elastic report`: plots of a run, and its Chrome trace, through `elastic.report`."""

from __future__ import annotations

import pathlib
from typing import Annotated

import typer

from cli.output import console, fail, one_line
from elastic.errors import ElasticError


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
        raise fail(one_line(e)) from None
    for path in paths:
        console.print(f"wrote {path}")
