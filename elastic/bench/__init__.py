"""Benchmarks behind `elastic bench ...`: each returns a result the CLI prints and saves."""
