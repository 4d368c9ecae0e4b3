"""CLI wiring only; the behaviour behind each command is tested through the Python API."""

import dataclasses

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


def test_bench_overhead_rejects_an_unknown_model_before_running_any_with_exit_code_2():
    result = runner.invoke(app, ["bench", "overhead", "--model", "mlp,gpt"])
    assert result.exit_code == 2
    assert "gpt" in result.output and "lm" in result.output


def test_run_with_a_missing_target_file_exits_2_naming_it():
    result = runner.invoke(app, ["run", "nowhere/job.py:job", "--workers", "2",
                                 "--global-batch", "8", "--max-steps", "1"])
    assert result.exit_code == 2
    assert "nowhere/job.py" in result.output


def test_run_with_an_invalid_configuration_exits_2_naming_the_setting():
    result = runner.invoke(app, ["run", "examples/spirals.py:job", "--workers", "4",
                                 "--min-workers", "5", "--global-batch", "8", "--max-steps", "1"])
    assert result.exit_code == 2
    assert "min_workers" in result.output


def test_run_with_a_malformed_kill_at_exits_2():
    result = runner.invoke(app, ["run", "examples/spirals.py:job", "--workers", "2",
                                 "--global-batch", "8", "--max-steps", "1", "--kill-at", "x"])
    assert result.exit_code == 2
    assert "STEP:RANK" in result.output


def test_the_option_surface_is_what_was_reviewed():
    import typer.main

    command = typer.main.get_command(app)
    surface = {}
    for name, sub in command.commands.items():
        if hasattr(sub, "commands"):
            for sub_name, leaf in sub.commands.items():
                surface[f"{name} {sub_name}"] = sorted(p.name for p in leaf.params)
        else:
            surface[name] = sorted(p.name for p in sub.params)
    assert surface == {
        "bench allreduce": ["algorithms", "hosts", "json_path", "plot", "registered",
                            "segment_bytes", "shared_memory", "sizes", "world_size"],
        "bench recovery": ["json_path", "replace", "seed", "trials", "workers"],
        "bench checkpoint": ["directory", "json_path", "size_mb", "trials"],
        "bench scaling": ["batch_sizes", "json_path", "model", "plot", "steps", "workers"],
        "bench adapt": ["batch", "json_path", "slow_factor", "steps", "workers"],
        "bench control": ["calls", "json_path"],
        "bench decisions": ["json_path", "members", "steps"],
        "bench exact": ["batch", "json_path", "models", "rounds", "steps", "workers"],
        "bench data": ["batch", "image_size", "json_path", "loader_workers", "rounds", "steps",
                       "workers"],
        "bench overhead": ["algorithm", "batch", "json_path", "model", "overlap", "rounds",
                           "steps", "steps_per_chunk", "workers"],
        "run": ["address", "algorithm", "backend", "batch_policy", "config", "csv", "debug",
                "epochs", "exact", "global_batch",
                "kill_at", "ledger", "loader_workers", "max_micro_batch", "max_steps",
                "max_workers", "min_workers",
                "name", "run_dir", "seed", "target", "tensorboard", "workers"],
        "start": ["address", "algorithm", "backend", "batch_policy", "config", "csv", "debug",
                  "epochs", "exact", "global_batch",
                  "kill_at", "ledger", "loader_workers", "max_micro_batch", "max_steps",
                  "max_workers", "min_workers",
                  "name", "run_dir", "seed", "target", "tensorboard", "workers"],
        "list": ["live"],
        "demo": ["epochs", "run_dir", "workers"],
        "report": ["out", "run_dir", "trace"],
        "logs": ["name"],
        "status": ["as_json", "name"],
        "scale": ["name", "num_workers"],
        "kill": ["name", "rank"],
        "stop": ["name"],
    }


def test_a_rebalance_that_did_not_deliver_is_told_with_what_comes_next():
    from cli.render import describe
    from elastic.events import RebalanceJudged

    missed = RebalanceJudged(step=16, delivered=False, realised_saving_s=0.0004,
                             predicted_saving_s=0.002, threshold=0.3, window=2)
    assert describe(missed) == ("the re-split saved 0.4 ms of a predicted 2.0 ms; the next one "
                                "needs 30% and is watched for 2 chunks")
    assert describe(dataclasses.replace(missed, delivered=True)) is None


def test_logs_prints_each_event_kind_and_its_line_and_unknown_kinds_by_name(monkeypatch):
    import elastic

    records = [{"time": 1.0, "event": "worker_joined", "worker_id": 6, "pid": 42},
               {"time": 2.0, "event": "from_a_newer_version", "x": 1}]
    monkeypatch.setattr(elastic, "events", lambda name: records)
    result = runner.invoke(app, ["logs", "some-run"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["   worker_joined  worker 6 joined",
                                          "from_a_newer_version  from_a_newer_version"]


def test_status_lists_the_ranks_that_train_and_counts_a_joining_worker_apart(monkeypatch):
    import elastic

    info = {"name": "r", "state": "resizing", "step": 6, "total_steps": 16, "last_loss": None,
            "started_at": None, "failures": 1, "run_dir": "/runs/r", "world_size": 1,
            "target_workers": 2, "generation": 1, "joining_workers": 1,
            "workers": [{"rank": 0, "worker_id": 0, "pid": 7, "node_id": "n0"}]}
    monkeypatch.setattr(elastic, "status", lambda name: info)
    result = runner.invoke(app, ["status", "r"])
    assert result.exit_code == 0, result.output
    assert "1 workers (target 2), generation 1, 1 joining" in result.output
    del info["joining_workers"]  # the record of a run from before the field
    result = runner.invoke(app, ["status", "r"])
    assert result.exit_code == 0 and "joining" not in result.output, result.output


def test_run_exact_turns_exact_mode_on_over_a_config_file(tmp_path):
    import inspect

    from cli.train import _prepare, _training_options

    options = {name: p.default for name, p in inspect.signature(_training_options).parameters.items()}
    config_file = tmp_path / "fit.toml"
    config_file.write_text('max_steps = 3\n[scaling]\nnum_workers = 2\n[batch]\nglobal_batch_size = 8\n')
    options.update(target="examples/spirals.py:job", config=config_file, exact=True)
    config, _ = _prepare(options)
    assert config.batch.exact and config.batch.global_batch_size == 8
    options["exact"] = False
    assert not _prepare(options)[0].batch.exact
