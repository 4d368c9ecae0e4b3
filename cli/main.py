"""`elastic` command line. Each command parses, calls the Python API, prints, exits.

Bad input exits with code 2 and one line naming what to fix.
"""

from __future__ import annotations

import json
import pathlib
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from elastic.bench.allreduce import parse_size, plot_allreduce, run_allreduce_bench
from elastic.config import ALGORITHMS

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Elastic, fault-tolerant data-parallel training on Ray.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print a table and write JSON.")
app.add_typer(bench_app, name="bench")
console = Console()


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {message}")
    return typer.Exit(code=2)


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
) -> None:
    """Time every allreduce algorithm at every size, check results, fit alpha-beta."""
    try:
        size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
    except ValueError as e:
        raise _fail(f"--sizes: {e}") from None
    algorithm_list = [a.strip() for a in algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithm_list if a not in ALGORITHMS]
    if unknown:
        raise _fail(f"--algorithms: unknown {', '.join(unknown)}; choose from {', '.join(ALGORITHMS)}")
    try:
        result = run_allreduce_bench(world_size, size_list, algorithm_list)  # type: ignore[arg-type]
    except ValueError as e:
        raise _fail(str(e)) from None
    table = Table(title=f"allreduce, {world_size} ranks (memcpy {result.memcpy_gbps:.2f} GB/s, "
                        f"loopback TCP {result.loopback_tcp_gbps:.2f} GB/s)")
    for column in ("algorithm", "size", "median ms", "algbw GB/s", "busbw GB/s",
                   "busbw / TCP", "correct"):
        table.add_column(column, justify="right")
    for r in result.records:
        table.add_row(r.algorithm, _human(r.size_bytes), f"{r.median_s * 1e3:.3f}",
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
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result.to_json(), indent=2))
        console.print(f"wrote {json_path}")
    if plot:
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot_allreduce(result, str(plot))
        console.print(f"wrote {plot}")
    if not all(r.correct for r in result.records):
        raise _fail("some results were wrong (see the 'correct' column)")


def main() -> None:
    app()
