"""The `elastic` command line: a thin typer layer over the public Python API."""
