"""What every command prints through: the console, one-line errors, files the user asked for.

Bad input exits with code 2 and one line naming what to fix (`fail`).
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable

import pydantic
import typer
from rich.console import Console
from rich.markup import escape

console = Console()


def fail(message: str) -> typer.Exit:
    """Prints `message` as an error; the caller raises the returned exit (code 2). The message
    is plain text: square brackets in it (`[1, 4]`, `elastic[loggers]`) are printed as they are,
    and it is not broken into lines at the console's width (a path or a command in it stays
    whole to copy; the terminal wraps it)."""
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    return typer.Exit(code=2)


def one_line(e: Exception) -> str:
    """The first line of `e`'s message; for a configuration error, the first problem and where."""
    if isinstance(e, pydantic.ValidationError):
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "config"
        return f"invalid configuration: {where}: {first['msg']} ({e.error_count()} problem(s))"
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def save(path: pathlib.Path | None, write: Callable[[pathlib.Path], object]) -> None:
    """Writes an output the user asked for (`--json`, `--plot`), creating its folder.

    Args:
        path: where; None (not asked for) writes nothing.
        write: writes the file at the path it is given.
    """
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path)
    console.print(f"wrote {path}")


def save_json(path: pathlib.Path | None, data: dict) -> None:
    """Writes `data` as indented JSON to `path` (`--json`), if given."""
    save(path, lambda p: p.write_text(to_json(data, indent=2)))


def to_json(data: object, indent: int | None = None) -> str:
    """`data` as standard JSON: a NaN or infinite number (a skipped step's loss, an evaluation
    over nothing) is null, which every JSON reader takes (Python writes NaN, which `jq` and
    most other readers refuse)."""
    return json.dumps(_finite(data), indent=indent, allow_nan=False)


def _finite(data: object) -> object:
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data
