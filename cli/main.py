"""`elastic` command line. Each command parses, calls the Python API, prints, exits.

Bad input exits with code 2 and one line naming what to fix. The commands live by concern:

- `cli/train.py`: `run`, `start`, `resume`, `demo` (and the option set `run` and `start` share);
- `cli/report.py`: `report`;
- `cli/control.py`: `list`, `logs`, `status`, `scale`, `kill`, `drain`, `stop`;
- `cli/bench.py`: `bench ...`;
- `cli/render.py`: events as text; `cli/output.py`: the console, errors, output files.
"""

from __future__ import annotations

import typer

from cli import bench, control, report, train

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Elastic, fault-tolerant data-parallel training on Ray.")
app.add_typer(bench.app, name="bench")
# In the order `elastic --help` lists them.
app.command()(train.run)
app.command()(train.start)
app.command()(train.resume)
app.command()(train.demo)
app.command()(report.report)
app.command("list")(control.list_runs)
app.command()(control.logs)
app.command()(control.status)
app.command()(control.scale)
app.command()(control.kill)
app.command()(control.drain)
app.command()(control.stop)


def main() -> None:
    """Runs the command line (the `elastic` console script calls `app` directly)."""
    app()
