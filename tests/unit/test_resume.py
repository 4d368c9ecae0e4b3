"""`elastic resume` and checkpoints on the command line (issue 42), without Ray: the options
map to CheckpointConfig, and a resume refuses what it cannot resume, each with one clear
message. (The whole path, a driver killed with SIGKILL then `elastic resume NAME`:
tests/integration/test_resume.py.)"""

from __future__ import annotations

import inspect
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

import elastic
from cli.main import app
from elastic.config import BatchConfig, ChaosEvent, CheckpointConfig, FitConfig, ScalingConfig
from elastic.errors import ConfigError, RunNotFoundError
from elastic.launch import read_launch, resume_config, write_launch
from elastic.registry import RunRegistry

runner = CliRunner()


def _options(**values):
    from cli.train import _training_options

    options = {n: p.default for n, p in inspect.signature(_training_options).parameters.items()}
    options.update(values)
    return options


@pytest.mark.parametrize(("every", "field", "value"), [("500", "every_steps", 500),
                                                       ("30s", "every_seconds", 30.0),
                                                       ("10m", "every_seconds", 600.0),
                                                       ("2h", "every_seconds", 7200.0)])
def test_checkpoint_options_map_to_checkpoint_config(every, field, value):
    from cli.train import _config_tree

    tree = _config_tree(_options(checkpoint="/ckpt", checkpoint_every=every, keep_last=2))
    assert tree["checkpoint"] == {"path": "/ckpt", field: value, "keep_last": 2}


def test_a_bad_checkpoint_interval_or_one_without_a_folder_exits_2_naming_the_option():
    args = ["run", "examples/spirals.py:job", "--workers", "2", "--global-batch", "8",
            "--max-steps", "1"]
    result = runner.invoke(app, [*args, "--checkpoint", "/tmp/x", "--checkpoint-every", "10x"])
    assert result.exit_code == 2 and "--checkpoint-every" in result.output
    result = runner.invoke(app, [*args, "--checkpoint-every", "5"])
    assert result.exit_code == 2 and "--checkpoint is required" in result.output


def _ended_run(home, tmp_path, name="r1", *, state="lost", checkpoint=True, target=None,
               batch=None, epochs=None):
    """A run's record, run dir (its start event) and launch record, as a run leaves them."""
    run_dir = tmp_path / "runs" / name
    config = FitConfig(
        name=name, run_dir=str(run_dir), max_steps=40, epochs=epochs,
        scaling=ScalingConfig(num_workers=2, max_workers=2),
        batch=batch or BatchConfig(global_batch_size=16),
        checkpoint=CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=5) if checkpoint else None,
        chaos=(ChaosEvent(step=3, rank=1, action="kill"),))
    os.makedirs(run_dir, mode=0o700)
    with open(run_dir / "events.jsonl", "w") as f:
        f.write(json.dumps({"time": 1.0, "event": "start", "name": name,
                            "config": config.model_dump(mode="json")}) + "\n")
    RunRegistry(str(home)).write({"name": name, "state": state, "step": 12, "run_dir": str(run_dir),
                                  "total_steps": 40})
    if target is not None:
        write_launch(str(run_dir), target)
    return run_dir


def test_resume_config_is_the_started_one_without_its_chaos_and_takes_a_new_size(tmp_path):
    run_dir = _ended_run(tmp_path / "home", tmp_path)
    record = RunRegistry(str(tmp_path / "home")).read("r1")
    config = resume_config("r1", record, None)
    assert config.name == "r1" and config.run_dir == str(run_dir) and config.chaos == ()
    assert config.checkpoint.path == str(tmp_path / "ckpt") and config.max_steps == 40
    wider = resume_config("r1", record, None, num_workers=3,
                          overrides={"logging.progress": "lines"})
    assert (wider.scaling.num_workers, wider.scaling.upper) == (3, 3)
    assert wider.logging.progress == "lines"
    # G followed the 2 workers it started with (16 / 2): at 3 it stays, and with it the
    # math of a model with BatchNorm or dropout; a G the run set stays as it is.
    assert config.batch.group_size is None and wider.batch.group_size == 8
    assert resume_config("r1", record, None, num_workers=2).batch.group_size is None


def test_resume_at_another_size_keeps_the_math_or_refuses_a_batch_that_follows_the_size(
        tmp_path):
    home = tmp_path / "home"
    _ended_run(home, tmp_path, "set", batch=BatchConfig(global_batch_size=16, group_size=4))
    _ended_run(home, tmp_path, "scaled", batch=BatchConfig(global_batch_size=16,
                                                           policy="scale_with_workers"))
    _ended_run(home, tmp_path, "epochs", epochs=3)
    registry = RunRegistry(str(home))
    assert resume_config("set", registry.read("set"), None, num_workers=4).batch.group_size == 4
    with pytest.raises(ConfigError, match=r"'scale_with_workers'.*resuming it at 3 would change"):
        resume_config("scaled", registry.read("scaled"), None, num_workers=3)
    assert resume_config("scaled", registry.read("scaled"), None).scaling.num_workers == 2
    # --max-steps trains longer: the run's epochs would end it first.
    record = registry.read("epochs")
    assert resume_config("epochs", record, None).epochs == 3
    longer = resume_config("epochs", record, None, overrides={"max_steps": 500})
    assert (longer.epochs, longer.max_steps) == (None, 500)
    both = resume_config("epochs", record, None, overrides={"max_steps": 500, "epochs": 9})
    assert (both.epochs, both.max_steps) == (9, 500)
    # A job that implies its epochs (a Lightning module's max_epochs): they go too, else the
    # configuration would contradict the job.
    import dataclasses

    from elastic.api import _asked_over_implied
    from elastic.config import with_job_settings
    from tests.jobs import regression_job

    implied = dataclasses.replace(regression_job(), settings={"epochs": 3})
    kept = _asked_over_implied(implied, {"max_steps": 500}, None)
    assert kept.settings == {}
    assert _asked_over_implied(implied, {"logging.progress": "lines"}, None).settings == {
        "epochs": 3}
    assert with_job_settings(longer, kept.settings, "the module").max_steps == 500
    with pytest.raises(ConfigError, match="implies epochs=3"):
        with_job_settings(longer, implied.settings, "the module")


def test_resume_refuses_a_live_or_finished_run_one_without_checkpoints_and_a_bad_size(tmp_path):
    _ended_run(tmp_path / "home", tmp_path, "live", state="running")
    _ended_run(tmp_path / "home", tmp_path, "done", state="finished")
    _ended_run(tmp_path / "home", tmp_path, "bare", checkpoint=False)
    _ended_run(tmp_path / "home", tmp_path, "r1")
    registry = RunRegistry(str(tmp_path / "home"))
    with pytest.raises(ConfigError, match=r"still running.*elastic stop live"):
        resume_config("live", registry.read("live"), None)
    with pytest.raises(ConfigError, match="finished: there is nothing to resume"):
        resume_config("done", registry.read("done"), None)
    with pytest.raises(ConfigError, match=r"wrote no checkpoints.*--checkpoint DIR"):
        resume_config("bare", registry.read("bare"), None)
    # A change the configuration refuses is one line naming the setting, not a traceback.
    with pytest.raises(ConfigError) as raised:
        resume_config("r1", registry.read("r1"), None,
                      overrides={"batch.global_batch_size": 0})
    assert str(raised.value).startswith("run 'r1' cannot be resumed so: batch.global_batch_size:")
    assert "\n" not in str(raised.value)
    result = runner.invoke(app, ["resume", "r1", "--workers", "0"])
    assert result.exit_code == 2 and "--workers" in result.output


def test_a_relative_checkpoint_folder_is_found_from_where_the_run_started(tmp_path, monkeypatch):
    from cli.train import _config_tree

    monkeypatch.chdir(tmp_path)
    tree = _config_tree(_options(checkpoint="ckpt", checkpoint_every="5"))
    assert tree["checkpoint"]["path"] == str(tmp_path / "ckpt")  # made absolute at the start
    # A record of an older start that kept it relative: resolved against its directory.
    home = tmp_path / "home"
    run_dir = _ended_run(home, tmp_path, "rel", target="examples/spirals.py:job")
    events = (run_dir / "events.jsonl").read_text().replace(str(tmp_path / "ckpt"), "ckpt")
    (run_dir / "events.jsonl").write_text(events)
    monkeypatch.chdir("/")
    config = resume_config("rel", RunRegistry(str(home)).read("rel"), read_launch(str(run_dir)))
    assert config.checkpoint.path == str(tmp_path / "ckpt")


def test_the_checkpoint_key_comes_from_the_home_that_signed_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "signer"))
    run_dir = _ended_run(tmp_path / "home", tmp_path, target="examples/spirals.py:job")
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "other"))
    launch = read_launch(str(run_dir))
    assert launch.elastic_home == str(tmp_path / "signer") and launch.target_sha256
    config = resume_config("r1", RunRegistry(str(tmp_path / "home")).read("r1"), launch)
    assert config.checkpoint.key_file == str(tmp_path / "signer" / "keys" / "checkpoint.key")


def test_resume_by_name_refuses_what_it_cannot_resume(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("ELASTIC_HOME", str(home))
    with pytest.raises(RunNotFoundError, match="no run named 'nope'"):
        elastic.resume("nope")
    _ended_run(home, tmp_path, "from-python")  # started from Python: no launch record
    with pytest.raises(ConfigError, match=r"pass it again, elastic.resume\(name, job=...\)"):
        elastic.resume("from-python")
    # A target file changed since the run started: refused unless forced.
    target = tmp_path / "job_file.py"
    shutil.copy("examples/spirals.py", target)
    monkeypatch.chdir(tmp_path)
    _ended_run(home, tmp_path, "changed", target="job_file.py:job")
    target.write_text(target.read_text() + "\n# edited\n")
    result = runner.invoke(app, ["resume", "changed"])
    assert result.exit_code == 2 and "changed since run 'changed' started" in result.output
    assert "--force" in result.output
    # Forced: the target loads, and with no checkpoint under its path, nothing is resumed.
    from elastic.checkpoint.signing import load_or_create_key

    load_or_create_key()  # the home's key exists; no checkpoint was signed with it
    result = runner.invoke(app, ["resume", "changed", "--force"])
    assert result.exit_code == 2 and "has no valid checkpoint under" in result.output
    # The file as it is now is the run's target from then on: no --force needed again.
    result = runner.invoke(app, ["resume", "changed"])
    assert "changed since" not in result.output and "has no valid checkpoint" in result.output


# --- errors that name the cause ------------------------------------------------------------


def test_a_folder_named_elastic_in_the_working_directory_is_refused_naming_both(tmp_path,
                                                                                monkeypatch):
    from elastic.shipping import package_origin

    (tmp_path / "elastic").mkdir()
    (tmp_path / "elastic" / "__init__.py").write_text("")  # shadows any install
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["run", f"{os.path.dirname(elastic.__file__)}/../examples/"
                                        "spirals.py:job", "--workers", "2", "--global-batch", "8",
                                 "--max-steps", "1", "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"{tmp_path}/elastic would be imported as elastic" in text
    assert package_origin()[0] in text.replace(" ", "")  # wrapped lines joined again


def test_a_process_with_another_elastic_than_the_drivers_refuses_naming_both(monkeypatch):
    from elastic import shipping

    folder, version = shipping.package_origin()
    shipping.check_origin((folder, version), "worker 3")  # the same: nothing to say
    with pytest.raises(ConfigError) as raised:
        shipping.check_origin(("/other/site-packages/elastic", "9.9.9"), "worker 3")
    message = str(raised.value)
    assert f"worker 3 imports elastic {version} from {folder}" in message
    assert "the driver runs elastic 9.9.9 from /other/site-packages/elastic" in message
    import elastic as package

    monkeypatch.delattr(package, "__file__")  # a namespace package: a folder named elastic
    with pytest.raises(ConfigError, match="a namespace package"):
        shipping.check_origin((folder, version), "the controller")


def test_an_unpicklable_factory_is_named_down_to_the_object():
    import threading

    import cloudpickle

    from elastic.shipping import unpicklable

    lock = threading.Lock()

    def make_model():
        return lock

    assert unpicklable({"model": print}, cloudpickle.dumps) is None
    message = unpicklable({"optimizer": print, "model": make_model}, cloudpickle.dumps)
    assert message.startswith("TrainJob.model cannot be sent to the workers: ")
    assert "make_model -> closure variable 'lock' is a _thread.lock" in message


def test_the_resumed_event_says_which_run_wrote_the_checkpoint_and_what_changed(tmp_path):
    from elastic.control.checkpoints import CheckpointCoordinator
    from elastic.runlog import RunLog

    class Worker:  # what `WorkerActor.restore_checkpoint` answers
        def call(self, worker_id, method):
            assert method == "restore_checkpoint"
            return {"step": 200, "path": "/ckpt/step-200", "skipped": [],
                    "fingerprint": "B=16;seed=0", "world_size": 2, "run": "resume3",
                    "dataset_size": 1000,
                    "environment_change": "environment torch '2.12.0' -> '2.13.0'"}

    config = FitConfig(max_steps=300, scaling=ScalingConfig(num_workers=3),
                       batch=BatchConfig(global_batch_size=16),
                       checkpoint=CheckpointConfig(path=str(tmp_path / "ckpt")))
    log = RunLog(str(tmp_path))
    coordinator = CheckpointCoordinator(config, log, Worker())
    coordinator.group_size, coordinator.dataset_size = 4, 1200
    assert coordinator.restore(0, "resumed", 0, world_size=3) == 200
    [event] = [e for e in log.events if e["event"] == "resumed"]
    assert event["from_run"] == "resume3" and event["world_size_then"] == 2
    assert event["world_size_now"] == 3
    assert event["changes"][0] == "world size 2 -> 3"
    assert event["changes"][1].startswith("B=16;seed=0 -> B=16;seed=0;G=4 (the math of a step")
    data = ("data set 1000 -> 1200 samples (the checkpoint's place in its epoch is read in "
            "the new length's order: until that epoch ends, samples may be seen twice or "
            "skipped)")
    assert event["changes"][2] == data
    assert event["changes"][3].startswith("environment torch '2.12.0' -> '2.13.0' (exact mode")
    assert [e["note"] for e in log.events if e["event"] == "checkpoint_config_changed"][1:] == [
        data]
    assert coordinator.resumed == {"step": 200, "run": "resume3", "path": "/ckpt/step-200"}
    [event] = [e for e in log.events if e["event"] == "resumed"]
    assert (event.get("reached"), event["work_lost_steps"]) == (None, 0)  # another run wrote it


def test_a_run_resumed_by_name_says_how_many_steps_it_redoes(tmp_path):
    from elastic.control.checkpoints import CheckpointCoordinator
    from elastic.events import parse
    from elastic.progress import describe
    from elastic.runlog import RunLog

    class Worker:
        def call(self, worker_id, method):
            return {"step": 200, "path": "/ckpt/step-200", "skipped": [], "run": "resume3",
                    "fingerprint": "B=16;seed=0", "world_size": 3}

    config = FitConfig(max_steps=300, scaling=ScalingConfig(num_workers=3),
                       batch=BatchConfig(global_batch_size=16),
                       checkpoint=CheckpointConfig(path=str(tmp_path / "ckpt")))
    earlier = RunLog(str(tmp_path))  # the lost run, in the same run dir, committed 205 steps
    for step in range(205):
        earlier.metric(step=step, loss=1.0)
    earlier.close()
    log = RunLog(str(tmp_path))
    coordinator = CheckpointCoordinator(config, log, Worker())
    coordinator.run_name = "resume3"
    assert coordinator.restore(0, "resumed", 0, world_size=3) == 200
    [event] = [e for e in log.events if e["event"] == "resumed"]
    assert (event["reached"], event["work_lost_steps"]) == (205, 5)
    assert describe(parse(event)) == ("resumed from step 200 of run resume3, written at world "
                                      "size 3 (/ckpt/step-200); 5 steps redone (it had reached "
                                      "step 205)")


def test_a_run_that_ends_at_the_step_it_resumed_from_does_not_write_that_checkpoint_again(
        tmp_path):
    # Before: the final write rewrote the checkpoint it had just loaded (a stop, Ctrl-C or
    # full disk during that write could lose the only copy).
    from elastic.control.checkpoints import CheckpointCoordinator
    from elastic.runlog import RunLog

    class Worker:
        calls: list[str] = []

        def call(self, worker_id, method, *args):
            self.calls.append(method)
            if method == "flush_checkpoints":
                return []
            assert method == "restore_checkpoint"
            return {"step": 300, "path": "/ckpt/step-300", "skipped": [], "run": "r",
                    "fingerprint": "B=16;seed=0", "world_size": 3}

    config = FitConfig(max_steps=300, scaling=ScalingConfig(num_workers=3),
                       batch=BatchConfig(global_batch_size=16),
                       checkpoint=CheckpointConfig(path=str(tmp_path / "ckpt")))
    worker = Worker()
    coordinator = CheckpointCoordinator(config, RunLog(str(tmp_path)), worker)
    assert coordinator.restore(0, "resumed", 0, world_size=3) == 300
    coordinator.maybe_write(0, 300, 3, final=True)
    assert "checkpoint" not in worker.calls


def test_a_resume_over_checkpoints_that_are_all_damaged_refuses_to_start_over(tmp_path):
    # Before: it started from step 0 on top of them, and retention then deleted them.
    from elastic.checkpoint.store import newest_checkpoint, none_loaded, write_checkpoint
    from elastic.control.checkpoints import CheckpointCoordinator
    from elastic.runlog import RunLog

    root = tmp_path / "ckpt"
    write_checkpoint(str(root), 100, {"model": b"x" * 64}, {})
    (root / "step-000000000100" / "model.pt").write_bytes(b"y" * 64)  # same size, other bytes
    (root / "step-000000000200").mkdir()  # a write interrupted before its manifest
    config = FitConfig(max_steps=300, scaling=ScalingConfig(num_workers=3),
                       batch=BatchConfig(global_batch_size=16),
                       checkpoint=CheckpointConfig(path=str(root), sign=False))

    class Worker:  # what `WorkerActor.restore_checkpoint` answers when nothing loads
        def call(self, worker_id, method):
            loaded, skipped = newest_checkpoint(str(root))
            assert loaded is None
            return none_loaded(skipped)

    coordinator = CheckpointCoordinator(config, RunLog(str(tmp_path / "run")), Worker())
    with pytest.raises(ConfigError) as raised:
        coordinator.restore(0, "resumed", 0, world_size=3)
    assert str(raised.value) == (
        f"checkpoint.path {str(root)!r} holds 1 checkpoint(s), none of which loads (newest: "
        f"step-000000000100: {root}/step-000000000100/model.pt: checksum mismatch); the run "
        "does not start over on top of them. Repair or remove the damaged step folders, or "
        "point checkpoint.path at a new folder")
    (root / "step-000000000100" / "MANIFEST.json").unlink()  # nothing was ever committed
    assert coordinator.restore(0, "resumed", 0, world_size=3) is None


def test_a_launch_record_another_could_have_written_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    write_launch(str(run_dir), "examples/spirals.py:job")
    assert read_launch(str(run_dir)).target == "examples/spirals.py:job"
    os.chmod(run_dir / "launch.json", 0o666)  # it names the code `resume` runs
    with pytest.raises(ConfigError, match=r"refusing .*launch\.json"):
        read_launch(str(run_dir))
    os.chmod(run_dir / "launch.json", 0o600)
    os.chmod(run_dir, 0o777)
    with pytest.raises(ConfigError, match="writable by group or others"):
        read_launch(str(run_dir))


def test_a_live_record_of_another_host_is_asked_of_the_cluster_and_lost_if_unknown(
        tmp_path, monkeypatch):
    # A run index on shared storage (NFS home, a head pod recreated under a new name): the
    # record says running on node-a. Before, `resume` refused it as "still running" while
    # `stop` answered "not running": no way out but deleting the file.
    import elastic.api as api
    from elastic.actors import client
    from elastic.errors import RunNotFoundError

    home = tmp_path / "home"
    monkeypatch.setenv("ELASTIC_HOME", str(home))
    _ended_run(home, tmp_path, "elsewhere", state="running")
    registry = RunRegistry(str(home))
    record = registry.read("elsewhere")
    record.update(host="node-a", control="@elastic-gone", cluster="10.0.0.1:6379")
    registry.write(record)

    def unknown(name, request):
        raise RunNotFoundError(f"no run named {name!r} on this Ray cluster")

    monkeypatch.setattr(client, "call", unknown)
    # Its own cluster does not know it: lost, and resumed.
    monkeypatch.setattr(client, "cluster_address", lambda: "10.0.0.1:6379")
    refreshed, unverified = api._refresh_anywhere(registry.read("elsewhere"))
    assert refreshed["state"] == "lost" and not unverified
    assert resume_config("elsewhere", refreshed, None).name == "elsewhere"
    # Another cluster, or none to ask: it may be live where this host cannot see. Nothing
    # changes, and resume says what to do; --force takes its cluster for gone.
    for here in ("10.9.9.9:6379", None):
        monkeypatch.setattr(client, "cluster_address", lambda here=here: here)
        assert api._refresh_anywhere(registry.read("elsewhere")) == (
            registry.read("elsewhere"), True)
        with pytest.raises(ConfigError, match=r"recorded running on host node-a .*--force"):
            elastic.resume("elsewhere")
        forced, _ = api._refresh_anywhere(registry.read("elsewhere"), force=True)
        assert forced["state"] == "lost"
        # status, stop, ... say the same (before: "lost", and stop "nothing to stop").
        for ask in (lambda: elastic.status("elsewhere"), lambda: elastic.stop("elsewhere")):
            with pytest.raises(RunNotFoundError, match=r"recorded running on host node-a "
                               r"\(Ray cluster 10.0.0.1:6379\), which this process cannot "
                               r"reach: set RAY_ADDRESS to that cluster"):
                ask()
        assert registry.read("elsewhere")["state"] == "running"
    # A record of an older version names no cluster: lost when a cluster does not know it.
    monkeypatch.setattr(client, "cluster_address", lambda: "10.9.9.9:6379")
    older = {k: v for k, v in registry.read("elsewhere").items() if k != "cluster"}
    assert api._refresh_anywhere(older)[0]["state"] == "lost"
    # The cluster knows it: its answer, and resume refuses it as live, as before.
    monkeypatch.setattr(client, "call", lambda name, request: {**record, "step": 30})
    assert api._refresh_anywhere(registry.read("elsewhere")) == ({**record, "step": 30}, False)
    with pytest.raises(ConfigError, match=r"is still running; only a lost"):
        elastic.resume("elsewhere")


def test_a_run_cached_live_in_the_cluster_without_its_controller_reads_lost(tmp_path,
                                                                            monkeypatch):
    # Another host (no local record): a controller caches its first record, so that a
    # resumed run that is then lost no longer reads as the end an earlier run left there.
    import elastic
    from elastic.actors import client
    from elastic.errors import RunNotFoundError

    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "home"))

    def unknown(name, request):
        raise RunNotFoundError(f"no run named {name!r} on this Ray cluster")

    cached = {"name": "r9", "state": "running", "step": 7, "run_dir": str(tmp_path / "gone"),
              "workers": [{"rank": 0}], "started_at": 1.0}
    monkeypatch.setattr(client, "call", unknown)
    monkeypatch.setattr(client, "cached_record", lambda name: cached)
    seen = elastic.status("r9")
    assert seen["state"] == "lost" and seen["workers"] == [] and seen["step"] == 7
    monkeypatch.setattr(client, "cached_record", lambda name: {**cached, "state": "stopped"})
    assert elastic.status("r9")["state"] == "stopped"


def test_a_run_that_ends_as_it_is_asked_is_not_found_and_an_unknown_name_says_where_it_looked(
        tmp_path, monkeypatch):
    # `elastic list` or `status` while a run ends (its controller kills itself): Ray's actor
    # error was a traceback with exit code 1.
    import ray

    import elastic
    from elastic.actors import client
    from elastic.errors import RunNotFoundError

    class Controller:
        class answer:  # as Ray's actor method
            @staticmethod
            def remote(request):
                return "ref"

    def died(ref):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(client, "find", lambda name: Controller)
    monkeypatch.setattr(client.ray, "get", died)
    with pytest.raises(RunNotFoundError, match=r"run 'r1' ended as it was asked \(its "
                                               r"controller is gone: ActorDiedError\)"):
        client.call("r1", None)
    # A name in neither the index nor the cluster: the error says both.
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(client, "cached_record", lambda name: None)
    with pytest.raises(RunNotFoundError, match=r"ended as it was asked.*\(nor is it in the run "
                                               r"index, .*home"):
        elastic.status("typo")


@pytest.mark.parametrize("command", ["run", "start"])
def test_a_start_that_fails_before_the_run_began_keeps_the_earlier_runs_launch_record(
        tmp_path, monkeypatch, command):
    # Run 'exp' stopped; `elastic start other.py:job --name exp` then fails (no cluster, the
    # name taken): before, its target stayed in exp's launch record, and `elastic resume exp`
    # trained it on exp's checkpoints.
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "home"))
    run_dir = _ended_run(tmp_path / "home", tmp_path, "exp", target="examples/spirals.py:job")
    recorded = (run_dir / "launch.json").read_bytes()
    events = (run_dir / "events.jsonl").read_bytes()
    started = []

    def failing(job, config):
        if started:  # this time the run begins (its start event), then fails
            with open(run_dir / "events.jsonl", "a") as f:
                f.write(json.dumps({"time": 2.0, "event": "start", "name": "exp"}) + "\n")
        raise ConfigError("no cluster here")

    monkeypatch.setattr(elastic, "fit" if command == "run" else "start", failing)
    args = [command, "tests/jobs.py:regression_job", "--name", "exp", "--workers", "2",
            "--global-batch", "16", "--max-steps", "4", "--run-dir", str(run_dir)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "no cluster here" in result.output
    assert (run_dir / "launch.json").read_bytes() == recorded
    assert read_launch(str(run_dir)).target == "examples/spirals.py:job"
    # A run that began is what a resume restarts: its record stays.
    started.append(True)
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert read_launch(str(run_dir)).target == "tests/jobs.py:regression_job"
    assert (run_dir / "events.jsonl").read_bytes().startswith(events)
    # A first run of a name that fails before it began leaves no record.
    fresh = tmp_path / "runs" / "new"
    started.clear()
    result = runner.invoke(app, [*args[:3], "new", *args[4:-1], str(fresh)])
    assert result.exit_code == 2 and "no cluster here" in result.output
    assert fresh.exists() and not (fresh / "launch.json").exists()


def test_a_run_dir_that_cannot_be_one_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "home"))
    (tmp_path / "file").write_text("")
    result = runner.invoke(app, ["start", "tests/jobs.py:regression_job", "--name", "x",
                                 "--workers", "2", "--global-batch", "16", "--max-steps", "4",
                                 "--run-dir", str(tmp_path / "file" / "run")])
    assert result.exit_code == 2 and "run_dir" in result.output
    assert "Traceback" not in result.output


def test_a_checkpoint_over_the_same_samples_in_other_blocks_is_said_to_change_the_data(tmp_path):
    """A Ray Dataset materialised again in blocks of other sizes (the same total): the
    checkpoint's place in its epoch names other rows; the resumed event says so."""
    from elastic.control.checkpoints import CheckpointCoordinator
    from elastic.runlog import RunLog

    class Worker:  # what `WorkerActor.restore_checkpoint` answers
        layout = "aaaa"

        def call(self, worker_id, method):
            return {"step": 20, "path": "/ckpt/step-20", "skipped": [], "world_size": 2,
                    "run": "r", "dataset_size": 400, "data_layout": self.layout}

    config = FitConfig(max_steps=300, scaling=ScalingConfig(num_workers=2),
                       batch=BatchConfig(global_batch_size=16),
                       checkpoint=CheckpointConfig(path=str(tmp_path / "ckpt")))
    log = RunLog(str(tmp_path))
    coordinator = CheckpointCoordinator(config, log, Worker())
    coordinator.dataset_size, coordinator.data_layout = 400, "bbbb"
    coordinator.restore(0, "resumed", 0, world_size=2)
    [event] = [e for e in log.events if e["event"] == "resumed"]
    assert event["changes"] == ["data set blocks aaaa -> bbbb (the same samples in blocks of "
                                "other sizes: the checkpoint's place in its epoch names other "
                                "rows; until that epoch ends, samples may be seen twice or "
                                "skipped)"]
    Worker.layout = "bbbb"
    coordinator.restore(0, "resumed", 0, world_size=2)
    assert [e for e in log.events if e["event"] == "resumed"][-1]["changes"] == []
