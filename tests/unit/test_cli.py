"""CLI wiring only; the behaviour behind each command is tested through the Python API."""

import contextlib
import dataclasses
import inspect
import json
import os

import pytest
import typer
from typer.testing import CliRunner

from cli.main import app
from elastic.events import KINDS

runner = CliRunner()


def _text(output: str) -> str:
    """`output` with the help's box drawing and the console's line wrapping undone."""
    return " ".join(output.replace("│", " ").split())


def _options(**values):
    """The options `_prepare` gets, with their defaults and `values` over them."""
    from cli.train import _training_options

    options = {name: p.default for name, p in inspect.signature(_training_options).parameters.items()}
    options.update(values)
    return options


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


@pytest.mark.parametrize(("argv", "says"), [
    (["--device", "tpu"], "--device: 'cuda' or 'cpu', got 'tpu'"),
    (["--device", "cpu", "--size", "huge"], "--size: one of full, tiny, got 'huge'"),
    (["--device", "cpu"], "--device cpu runs only at --size tiny"),
    (["--device", "cpu", "--size", "tiny", "--shared", "1"], "--shared: 0 (none) or 2 and more"),
    (["--device", "cpu", "--size", "tiny", "--models", "gpt2,vit"], "--models: unknown vit"),
    (["--device", "cpu", "--size", "tiny", "--models", ","], "--models: unknown (none given)"),
    (["--device", "cpu", "--size", "tiny", "--models", "gpt2", "--shared", "9"],
     "--shared 9: more workers than samples per step of gpt2 (batch 8)"),
])
def test_bench_gpu_refuses_what_it_cannot_run_with_exit_code_2_before_any_run(argv, says,
                                                                               tmp_path):
    result = runner.invoke(app, ["bench", "gpu", "--out-dir", str(tmp_path / "out"), *argv])
    assert result.exit_code == 2 and says in _text(result.output), result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("argv", "says"), [
    (["preemption", "--spares", "0,x"],
     "--spares: whole numbers separated by commas (such as 0,1), got '0,x'"),
    (["step", "--depths", "4,-1"], "--depths: at least one number, each 0 or more, got '4,-1'"),
    (["drift", "--steps", ","], "--steps: at least one number, each 1 or more, got ','"),
    (["scaling", "--workers", "1,0"], "--workers: at least one number, each 1 or more"),
    (["scaling", "--batch-sizes", "64;256"], "--batch-sizes: whole numbers separated by commas"),
    (["decisions", "--members", "4,sixteen"], "--members: whole numbers separated by commas"),
    (["exact", "--workers", "2,two"], "--workers: whole numbers separated by commas"),
    (["memory", "--stages", "1,3"], "--stages: 0, 1 or 2, got '1,3'"),
])
def test_a_bench_list_option_that_is_not_whole_numbers_exits_2_naming_it(argv, says):
    result = runner.invoke(app, ["bench", *argv])
    assert result.exit_code == 2 and says in _text(result.output), result.output


def test_bench_gpu_without_cuda_says_how_to_rehearse_it(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = runner.invoke(app, ["bench", "gpu"])
    assert result.exit_code == 2
    assert "--device cpu --size tiny rehearses it on the CPU" in _text(result.output)


def test_bench_gpu_names_the_library_a_model_needs(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchvision" else real(name, *a))
    result = runner.invoke(app, ["bench", "gpu", "--device", "cpu", "--size", "tiny",
                                 "--models", "resnet50"])
    assert result.exit_code == 2
    assert "resnet50 needs torchvision, not installed" in _text(result.output)


def test_run_with_a_missing_target_file_exits_2_naming_it():
    result = runner.invoke(app, ["run", "nowhere/job.py:job", "--workers", "2",
                                 "--global-batch", "8", "--max-steps", "1"])
    assert result.exit_code == 2
    assert "nowhere/job.py" in result.output


def test_run_checks_the_target_before_the_configuration():
    result = runner.invoke(app, ["run", "nowhere/job.py:job"])
    assert result.exit_code == 2
    assert "target file 'nowhere/job.py' does not exist" in _text(result.output)
    assert "configuration" not in result.output
    result = runner.invoke(app, ["run", "examples/spirals.py:no_such_job"])
    assert result.exit_code == 2
    assert "has no attribute 'no_such_job'" in _text(result.output)
    assert "configuration" not in result.output


def test_a_target_whose_own_config_is_invalid_is_told_as_the_targets_error(tmp_path):
    # Its FitConfig fails while it is imported: no option of the command line is involved.
    target = tmp_path / "bad_job.py"
    target.write_text("import elastic\nCONFIG = elastic.FitConfig(\n"
                      "    scaling=elastic.ScalingConfig(num_workers=2),\n"
                      "    batch=elastic.BatchConfig(global_batch_size=8), max_steps=0)\n")
    result = runner.invoke(app, ["run", f"{target}:job", "--workers", "2", "--global-batch", "8",
                                 "--max-steps", "1"])
    assert result.exit_code == 2, result.output
    assert "max_steps" in _text(result.output) and "--" not in _text(result.output)
    assert not isinstance(result.exception, UnboundLocalError)


def test_run_without_the_required_options_lists_every_problem_naming_its_option():
    result = runner.invoke(app, ["run", "examples/spirals.py:job"])
    assert result.exit_code == 2
    text = _text(result.output)
    assert "invalid configuration (3 problems)" in text
    assert "--workers is required (or scaling.num_workers in --config FILE)" in text
    assert "--global-batch is required (or batch.global_batch_size in --config FILE)" in text
    assert "--epochs or --max-steps is required" in text
    result = runner.invoke(app, ["run", "examples/spirals.py:job", "--workers", "0",
                                 "--global-batch", "8"])
    text = _text(result.output)
    assert result.exit_code == 2 and "(2 problems)" in text
    assert "--workers (scaling.num_workers): Input should be greater than or equal to 1" in text
    assert "--epochs or --max-steps is required" in text


def test_a_target_file_named_like_a_module_imported_already_is_refused(tmp_path, monkeypatch):
    # Before: the module already imported was taken for the file ("has no attribute 'job'"
    # for json.py; another folder's job file of the same name: that file's job, silently).
    import sys

    import elastic

    # load_target puts a file target's folder on the paths: not for the next tests' processes.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.delitem(sys.modules, "same_named_job", raising=False)

    code = "from tests.jobs import regression_job as job\n"
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        for name in ("json.py", "same_named_job.py"):
            (tmp_path / folder / name).write_text(code)
    with pytest.raises(elastic.errors.ConfigError,
                       match=r"json.py' is named like the module 'json', which is imported from "
                             r".*json.*: rename the file"):
        elastic.load_target(f"{tmp_path / 'a' / 'json.py'}:job")
    assert isinstance(elastic.load_target(f"{tmp_path / 'a' / 'same_named_job.py'}:job"),
                      elastic.TrainJob)
    assert isinstance(elastic.load_target(f"{tmp_path / 'a' / 'same_named_job.py'}:job"),
                      elastic.TrainJob)  # the same file again
    with pytest.raises(elastic.errors.ConfigError, match="named like the module 'same_named_job'"):
        elastic.load_target(f"{tmp_path / 'b' / 'same_named_job.py'}:job")


def test_an_end_the_job_implies_is_not_asked_for_again():
    # A Lightning module's max_epochs is the run's end: before, a bad --workers also printed
    # "--epochs or --max-steps is required", and following it failed as a conflict.
    pytest.importorskip("lightning")
    result = runner.invoke(app, ["run", "examples/lightning_mnist_like.py:job", "--workers",
                                 "0", "--global-batch", "64"])
    text = _text(result.output)
    assert result.exit_code == 2 and "invalid configuration: --workers" in text
    assert "--epochs or --max-steps" not in text


def test_a_configuration_error_with_square_brackets_is_printed_whole():
    result = runner.invoke(app, ["run", "examples/spirals.py:job", "--workers", "5", "--max-workers",
                                 "4", "--global-batch", "8", "--max-steps", "1"])
    assert result.exit_code == 2
    assert "[min_workers, max_workers] = [1, 4]" in _text(result.output)


def test_gpu_sets_scaling_use_gpu_over_a_config_file(tmp_path):
    from cli.train import _prepare

    options = _options(target="examples/spirals.py:job", workers=2, global_batch=8, max_steps=1,
                       backend="nccl", gpu=True)
    assert _prepare(options)[0].scaling.use_gpu
    config_file = tmp_path / "fit.toml"
    config_file.write_text('max_steps = 3\n[scaling]\nnum_workers = 2\nuse_gpu = true\n'
                           '[batch]\nglobal_batch_size = 8\n[collective]\nbackend = "nccl"\n')
    options = _options(target="examples/spirals.py:job", config=config_file)
    assert _prepare(options)[0].scaling.use_gpu
    options.update(gpu=False, backend="gloo")
    assert not _prepare(options)[0].scaling.use_gpu


def test_backend_nccl_without_a_gpu_names_the_option_that_gives_one():
    result = runner.invoke(app, ["run", "examples/spirals.py:job", "--workers", "2",
                                 "--global-batch", "8", "--max-steps", "1", "--backend", "nccl"])
    assert result.exit_code == 2
    assert "(command line: --backend, --gpu)" in _text(result.output)


def test_kill_at_a_rank_the_run_never_has_exits_2_naming_the_setting():
    result = runner.invoke(app, ["run", "examples/spirals.py:job", "--workers", "2",
                                 "--global-batch", "8", "--max-steps", "4", "--kill-at", "3:2"])
    assert result.exit_code == 2
    text = _text(result.output)
    assert "rank 2 at step 3" in text and "scaling.max_workers" in text and "--kill-at" in text


def test_demo_on_one_worker_exits_2_before_training():
    result = runner.invoke(app, ["demo", "--workers", "1"])
    assert result.exit_code == 2
    assert "--workers must be at least 2" in _text(result.output)


@pytest.mark.parametrize("command", ["run", "start", "demo", "report", "list", "logs", "status",
                                     "scale", "kill", "drain", "stop", "bench allreduce",
                                     "bench recovery", "bench preemption", "bench overhead",
                                     "bench scaling"])
def test_help_shows_every_option_help_whole_square_brackets_included(command):
    import typer.main

    click_command = typer.main.get_command(app)
    for name in command.split():
        click_command = click_command.commands[name]
    result = runner.invoke(app, [*command.split(), "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    text = _text(result.output)
    helps = [p.help for p in click_command.params if getattr(p, "help", None)]
    for help_text in helps:
        assert _text(help_text.replace("\\[", "[")) in text, help_text
    assert any("[" in h for h in helps) or command not in ("run", "start")


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
        "bench recovery": ["json_path", "replace", "seed", "sharding_stage", "trials", "workers"],
        "bench preemption": ["json_path", "seed", "spares", "trials", "workers"],
        "bench checkpoint": ["directory", "json_path", "size_mb", "trials"],
        "bench scaling": ["batch_sizes", "json_path", "model", "plot", "steps", "workers"],
        "bench adapt": ["batch", "json_path", "slow_factor", "steps", "workers"],
        "bench control": ["calls", "json_path"],
        "bench decisions": ["json_path", "members", "steps"],
        "bench exact": ["batch", "json_path", "models", "rounds", "steps", "workers"],
        "bench gpu": ["device", "models", "out_dir", "shared", "size"],
        "bench drift": ["json_path", "steps", "workers"],
        "bench step": ["batch", "depths", "device", "image_size", "json_path", "steps", "width"],
        "bench memory": ["json_path", "model", "replicas", "stages", "steps", "workers"],
        "bench data": ["batch", "image_size", "json_path", "loader_workers", "rounds", "steps",
                       "workers"],
        "bench overhead": ["algorithm", "batch", "json_path", "model", "overlap", "rounds",
                           "steps", "steps_per_chunk", "workers"],
        "run": ["address", "algorithm", "backend", "batch_policy", "checkpoint",
               "checkpoint_every", "config", "csv", "debug", "epochs", "exact", "global_batch",
               "gpu", "gpus_per_worker", "keep_last", "kill_at", "ledger", "loader_workers",
               "max_micro_batch", "max_steps", "max_workers", "min_workers", "name", "run_dir",
               "seed", "shard_replicas", "sharding_stage", "spares", "target", "tensorboard",
               "workers"],
        "start": ["address", "algorithm", "backend", "batch_policy", "checkpoint",
                 "checkpoint_every", "config", "csv", "debug", "epochs", "exact", "global_batch",
                 "gpu", "gpus_per_worker", "keep_last", "kill_at", "ledger", "loader_workers",
                 "max_micro_batch", "max_steps", "max_workers", "min_workers", "name", "run_dir",
                 "seed", "shard_replicas", "sharding_stage", "spares", "target", "tensorboard",
                 "workers"],
        "resume": ["address", "debug", "detach", "force", "max_steps", "name", "workers"],
        "list": ["live"],
        "demo": ["epochs", "run_dir", "workers"],
        "report": ["out", "run_dir", "trace"],
        "logs": ["name"],
        "status": ["as_json", "name"],
        "scale": ["name", "num_workers"],
        "kill": ["name", "rank"],
        "drain": ["deadline", "name", "node", "rank"],
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


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logs_describes_every_event_kind_in_a_line_of_its_own(kind):
    from elastic.events import build
    from elastic.progress import _LOG_RENDERERS, describe, log_description
    from tests.unit.test_events import SAMPLES

    event = build(kind, **SAMPLES[kind])
    line = log_description(event)
    assert line and line != kind and "\n" not in line
    assert type(event) in _LOG_RENDERERS or describe(event), f"no description of {kind!r}"


def test_logs_tells_state_changes_and_generations_in_full(monkeypatch):
    import elastic

    records = [{"time": 1.0, "event": "state", "previous": "running", "state": "recovering",
                "lost_ranks": [1]},
               {"time": 2.0, "event": "generation", "generation": 2, "world_size": 3,
                "reason": "recovery", "source_rank": 0, "step": 9, "transport": "shm",
                "workers": [3, 4, 6]}]
    monkeypatch.setattr(elastic, "events", lambda name: records)
    result = runner.invoke(app, ["logs", "some-run"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "           state  running -> recovering (lost ranks 1)",
        "      generation  generation 2: 3 workers (recovery), state of step 9 from rank 0 over "
        "shm; workers by rank 3, 4, 6"]


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
    # --json is standard JSON: a skipped step's NaN loss is null (Python's NaN is not JSON).
    info.update(last_loss=float("nan"), evaluation={"acc": float("inf"), "n": 3.0})
    result = runner.invoke(app, ["status", "r", "--json"])
    assert result.exit_code == 0, result.output
    read = json.loads(result.output, parse_constant=lambda c: pytest.fail(f"{c} in the output"))
    assert read["last_loss"] is None and read["evaluation"] == {"acc": None, "n": 3.0}


def test_sharding_options_set_the_sharding_config_and_bad_values_name_the_option(capsys):
    from cli.train import _prepare

    options = _options()
    options.update(target="examples/spirals.py:job", workers=3, global_batch=12, max_steps=2,
                   sharding_stage=1, shard_replicas=3)
    config, _ = _prepare(options)
    assert (config.sharding.stage, config.sharding.replicas) == (1, 3)
    options.update(shard_replicas=4)
    with pytest.raises(typer.Exit) as raised:
        _prepare(options)
    assert raised.value.exit_code == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "sharding.replicas (4) exceeds scaling.num_workers (3)" in out
    assert "--shard-replicas" in out and "--workers" in out


def test_run_exact_turns_exact_mode_on_over_a_config_file(tmp_path):
    from cli.train import _prepare

    options = _options()
    config_file = tmp_path / "fit.toml"
    config_file.write_text('max_steps = 3\n[scaling]\nnum_workers = 2\n[batch]\nglobal_batch_size = 8\n')
    options.update(target="examples/spirals.py:job", config=config_file, exact=True)
    config, _ = _prepare(options)
    assert config.batch.exact and config.batch.global_batch_size == 8
    options["exact"] = False
    assert not _prepare(options)[0].batch.exact


def test_a_jobs_settings_fill_the_command_line_and_a_contradiction_exits_2_naming_both(tmp_path):
    from cli.train import _prepare

    target = tmp_path / "framework_job.py"
    target.write_text(
        "import torch\nimport elastic\n"
        "job = elastic.TrainJob(model=lambda: torch.nn.Linear(2, 1), optimizer=torch.optim.SGD,\n"
        "                       loss=lambda m, b: m(b).sum(), dataset=lambda: torch.zeros(8, 2),\n"
        "                       settings={'epochs': 2, 'batch.global_batch_size': 8,\n"
        "                                 'training.clip_grad_norm': 1.0},\n"
        "                       source='the framework adapter')\n")
    config, _ = _prepare(_options(target=f"{target}:job", workers=2))
    assert (config.epochs, config.batch.global_batch_size, config.training.clip_grad_norm) == (2, 8, 1.0)
    result = runner.invoke(app, ["run", f"{target}:job", "--workers", "2", "--epochs", "5"])
    assert result.exit_code == 2, result.output
    assert ("the framework adapter implies epochs=2, but the configuration sets epochs=5"
            in _text(result.output))


def test_run_without_a_name_never_reuses_an_earlier_runs_name(monkeypatch, tmp_path):
    # A container's entrypoint has the same process id at every start: a name made of it
    # would be taken by the next run, whose first metric supersedes the earlier run's file.
    import elastic
    from cli import train

    names = []

    @contextlib.contextmanager
    def recorded(name, *args):
        names.append(name)
        yield

    monkeypatch.setattr(train, "recorded_launch", recorded)
    monkeypatch.setattr(elastic, "fit", lambda job, config: (_ for _ in ()).throw(
        elastic.errors.ConfigError("stopped here")))
    for _ in range(2):
        result = runner.invoke(app, ["run", "examples/spirals.py:job", "--workers", "2",
                                     "--global-batch", "8", "--max-steps", "1",
                                     "--run-dir", str(tmp_path)])
        assert result.exit_code == 2 and "stopped here" in result.output
    assert len(set(names)) == 2 and all(str(os.getpid()) not in n for n in names)


def test_a_yaml_config_with_an_empty_section_takes_the_options_into_it(tmp_path):
    # `scaling:` with nothing under it is None in YAML: before, --workers failed with
    # "'NoneType' object does not support item assignment".
    from cli.train import _prepare

    config_file = tmp_path / "fit.yaml"
    config_file.write_text("max_steps: 3\nscaling:\nbatch:\n  global_batch_size: 8\n")
    options = _options(target="examples/spirals.py:job", config=config_file, workers=2)
    assert _prepare(options)[0].scaling.num_workers == 2
    config_file.write_text("max_steps: 3\nscaling: 4\nbatch:\n  global_batch_size: 8\n")
    result = runner.invoke(app, ["run", "examples/spirals.py:job", "--config", str(config_file),
                                 "--workers", "2"])
    assert result.exit_code == 2
    assert "scaling in --config FILE must be a section of settings, not 4" in _text(result.output)
    config_file.write_text("- 1\n- 2\n")
    result = runner.invoke(app, ["run", "examples/spirals.py:job", "--config", str(config_file)])
    assert result.exit_code == 2 and "its top level must be settings" in _text(result.output)
