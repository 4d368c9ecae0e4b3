"""Where a run keeps its record (`run_dir_of`): `FitConfig.run_dir`, else a default."""

from __future__ import annotations

import json
import os

import pytest
import torch

from elastic.api import run_dir_of
from elastic.config import storage_root


def _job(runtime_env) -> dict[str, str]:
    return {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": runtime_env, "metadata": {}})}


def test_a_run_dir_that_is_set_is_used_wherever_the_run_starts():
    assert run_dir_of("somewhere/r", "r", _job({"working_dir": "gcs://_ray_pkg_abc.zip"})) == (
        os.path.abspath("somewhere/r"))


def test_a_run_keeps_its_record_under_the_current_directory_by_default():
    assert run_dir_of(None, "r", {}) == os.path.abspath(os.path.join("runs", "r"))
    # A submitted job without a working directory runs where it was started: as usual.
    assert run_dir_of(None, "r", _job({"pip": ["x"]})) == os.path.abspath(os.path.join("runs", "r"))


def test_a_submitted_job_with_a_working_directory_keeps_it_under_elastic_home():
    # Its current directory is Ray's temporary copy of the working directory.
    expected = os.path.join(storage_root(), "run-dirs", "r")
    assert run_dir_of(None, "r", _job({"working_dir": "gcs://_ray_pkg_abc.zip"})) == expected


def test_an_unreadable_job_configuration_is_the_usual_default():
    for value in ("not json", "[1, 2]", json.dumps({"runtime_env": "x"})):
        assert run_dir_of(None, "r", {"RAY_JOB_CONFIG_JSON_ENV_VAR": value}) == os.path.abspath(
            os.path.join("runs", "r"))


def test_a_final_model_that_cannot_be_written_is_an_event_and_a_detached_controller_still_ends(
        tmp_path, monkeypatch):
    # A full disk as the run ends: before, the error escaped run() and a detached run's actor
    # stayed alive for ever (no ray.kill after it), holding the run's name.
    import types

    from elastic.actors import controller as module
    from elastic.runlog import RunLog

    taken = tmp_path / "a-file"  # a run dir that cannot hold files
    taken.write_text("")
    fake = types.SimpleNamespace(run_dir=str(taken), name="r", log=RunLog(str(tmp_path / "log")))
    module.Controller._write_final_model(fake, {"w": torch.zeros(2)})
    [event] = [e for e in fake.log.events if e["event"].startswith("final_model")]
    assert event["event"] == "final_model_failed" and "NotADirectoryError" in event["error"]

    killed = []
    monkeypatch.setattr(module.ray, "kill", lambda actor, no_restart: killed.append(no_restart))
    monkeypatch.setattr(module.ray, "get_runtime_context",
                        lambda: types.SimpleNamespace(current_actor="me"))

    def run():
        raise MemoryError("serialising the final model")

    with pytest.raises(MemoryError):
        module.Controller._run_detached(types.SimpleNamespace(run=run))
    assert killed == [True]


def test_an_answer_lost_with_its_node_is_a_lost_worker_that_the_next_member_replaces(monkeypatch):
    # A spot node reclaimed as the controller pulls the final weights from it: before, Ray's
    # ObjectLostError failed the run as "controller failed" (a bug of ours) instead of asking
    # the next member.
    import types

    import ray

    from elastic.actors import workers as module
    from elastic.errors import WorkerLostError

    class Actor:
        class model_state:  # as Ray's actor method
            @staticmethod
            def remote():
                return "ref"

    def lost(ref):
        raise ray.exceptions.ObjectReconstructionFailedError("00" * 28)

    monkeypatch.setattr(module.ray, "get", lost)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(
        sharding=types.SimpleNamespace(stage=0)), actors={3: Actor})
    with pytest.raises(WorkerLostError, match="the answer of worker 3 was lost with its node"):
        module.RayWorkers.call(fake, 3, "model_state")
