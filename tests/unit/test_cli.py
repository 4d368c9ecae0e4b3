"""CLI wiring only; the behaviour behind each command is tested through the Python API."""

from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()


def test_bench_allreduce_rejects_an_unknown_algorithm_with_exit_code_2():
    result = runner.invoke(app, ["bench", "allreduce", "--algorithms", "ring,butterfly"])
    assert result.exit_code == 2
    assert "butterfly" in result.output


def test_bench_allreduce_rejects_a_bad_size_with_exit_code_2():
    result = runner.invoke(app, ["bench", "allreduce", "--sizes", "12XB"])
    assert result.exit_code == 2
    assert "--sizes" in result.output
