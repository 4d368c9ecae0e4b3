"""elastic.fit on a local Ray cluster: the step contract, recovery, resize, user errors."""

import itertools
import json
import os
import pathlib
import re
import threading

import pytest
import torch

import elastic
from elastic import BatchConfig, ChaosEvent, FitConfig, ScalingConfig
from elastic.errors import ConfigError, RunNotFoundError, UserCodeError
from elastic.events import (
    CheckpointSkipped,
    CheckpointWritten,
    Evaluate,
    Generation,
    GenerationFailed,
    Recovered,
    Resized,
    RestoredFromCheckpoint,
    Resumed,
    StateChanged,
    UserError,
    WorkerFailure,
    WorkerJoined,
    WorkerStarting,
    read_events,
    read_jsonl,
)
from tests.events import of_kind
from tests.jobs import N_SAMPLES, failing_job, reference_weights, regression_job

pytestmark = pytest.mark.integration

B = 16
PER_EPOCH = N_SAMPLES // B  # 6 steps


def _config(tmp_path, **kwargs) -> FitConfig:
    base = {
        "scaling": ScalingConfig(num_workers=4, min_workers=1, max_workers=4),
        "batch": BatchConfig(global_batch_size=B, max_micro_batch=3),
        "run_dir": str(tmp_path / "run"),
    }
    base.update(kwargs)
    return FitConfig(**base)


def _events(result, cls):
    return of_kind(result.events, cls)


def _assert_weights_equal_reference(result, steps):
    reference = reference_weights(seed=0, global_batch=B, steps=steps)
    torch.testing.assert_close(result.model_state, reference, rtol=1e-9, atol=1e-10)


def test_uninterrupted_run_matches_plain_pytorch(ray_cluster, tmp_path):
    result = elastic.fit(regression_job(), _config(tmp_path, epochs=2))
    assert result.steps == 2 * PER_EPOCH
    assert result.samples == 2 * PER_EPOCH * B
    _assert_weights_equal_reference(result, result.steps)
    assert [m["step"] for m in result.metrics] == list(range(result.steps))
    assert {m["world_size"] for m in result.metrics} == {4}
    assert result.metrics[0]["shares"] == [4, 4, 4, 4]
    assert result.metrics[0]["micro_batch"] == 3
    assert [e.epoch for e in _events(result, Evaluate)] == [1, 2]
    # Four workers on one host: gradients travel through shared memory.
    assert [e.transport for e in _events(result, Generation)] == ["shared_memory"]
    on_disk = [json.loads(line) for line in open(os.path.join(result.run_dir, "metrics.jsonl"))]
    # The file's lines, but for the per-rank timeline, which stays on disk only.
    assert all(len(m.pop("timeline")) == 4 for m in on_disk) and on_disk == result.metrics


def test_two_kills_in_different_phases_end_with_the_reference_weights(ray_cluster, tmp_path,
                                                                      capfd):
    # And out of memory in rank 0 as it takes the newest state after the second kill: the
    # generation forms once more (the error typed across Ray), nobody dropped.
    chaos = (ChaosEvent(step=3, rank=1, action="kill", phase="backward"),
             ChaosEvent(step=8, rank=2, action="kill", phase="allreduce"),
             ChaosEvent(step=8, rank=0, action="oom", phase="restore"))
    result = elastic.fit(regression_job(), _config(tmp_path, max_steps=14, chaos=chaos))
    assert result.steps == 14
    [forming] = _events(result, GenerationFailed)
    assert forming.attempt == 1
    assert all("aborted" in e for e in forming.errors[1:])  # the peers it released
    assert re.match(r"rank \d+ \(worker \d+\) ran out of memory while generation \d+ formed "
                    r"\(restoring\): injected out-of-memory error at step 8, rank 0\. ",
                    forming.errors[0]), forming.errors[0]
    # Intended kills print no paragraph of Ray's from Python either (it goes to ray.log).
    captured = capfd.readouterr()
    assert "A worker died or was killed" not in captured.out + captured.err
    _assert_weights_equal_reference(result, 14)
    failures = _events(result, WorkerFailure)
    assert [f.lost_ranks for f in failures] == [[1], [2]]
    recovered = _events(result, Recovered)
    assert len(recovered) == 2
    for r in recovered:
        for key in ("detect_s", "abort_s", "rebuild_s", "restore_s", "first_step_s", "total_s"):
            assert getattr(r, key) is not None and getattr(r, key) >= 0
    # Uneven shares after shrinking to 3 workers: 16 = 6 + 5 + 5.
    assert [6, 5, 5] in [m["shares"] for m in result.metrics]
    # The report of this run: valid PNG images with content.
    from matplotlib.image import imread

    from elastic.report import write_report

    paths = write_report(result.run_dir, str(tmp_path / "report"))
    assert [os.path.basename(p) for p in paths] == ["training.png", "recoveries.png"]
    for path in paths:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
        image = imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0  # not a blank canvas
    # The step timeline: per step, data + forward/backward + exposed communication + optimizer
    # of the slowest rank add up to (at most) its step time; the Chrome trace has them per rank.
    on_disk = read_jsonl(os.path.join(result.run_dir, "metrics.jsonl"))
    # FitResult.metrics is the file's lines but for the per-rank timeline (kept out of memory)
    assert [(m["step"], sorted(m)) for m in result.metrics] == [
        (m["step"], sorted(set(m) - {"timeline"})) for m in on_disk]
    for m in on_disk:
        parts = m["data_s"] + m["forward_backward_s"] + m["comm_s"] + m["optimizer_s"]
        assert 0 < parts <= m["step_time_s"] + 1e-6
        assert len(m["timeline"]) == m["world_size"]
    from elastic.report import write_trace

    trace_path = tmp_path / "trace.json"
    count = write_trace(result.run_dir, str(trace_path))
    trace = json.loads(trace_path.read_text())["traceEvents"]
    assert len(trace) == count
    spans = [e for e in trace if e["ph"] == "X"]
    # Four spans per rank and step, but for a killed rank's last steps: with chunks handed out
    # ahead, a rank can die in the chunk ahead before its answer to the chunk before arrives
    # (the survivors' answers carry those steps; only the dead rank's timings are missing).
    missing = [(m["step"], rank) for m in on_disk
               for rank, row in enumerate(m["timeline"]) if row is None]
    for step, rank in missing:
        assert any(rank in f.lost_ranks and f.step - 2 * 8 <= step < f.step for f in failures)
    assert len(spans) == 4 * (sum(m["world_size"] for m in result.metrics) - len(missing))
    assert {e["tid"] for e in spans} == {0, 1, 2, 3}
    by_rank_step: dict = {}
    for e in spans:
        by_rank_step.setdefault((e["tid"], e["args"]["step"]), []).append(e)
    for phases in by_rank_step.values():
        assert [p["name"] for p in phases] == ["data", "forward/backward", "communication", "optimizer"]
        for before, after in itertools.pairwise(phases):
            assert after["ts"] == pytest.approx(before["ts"] + before["dur"], abs=1.0)
    assert sum(e["name"] == "worker lost" for e in trace if e["ph"] == "i") == 2


class Operator:
    """Drives a live run from another thread through the public API, as an operator would
    from another process. It waits on the run's status, never on the clock."""

    def __init__(self, name, script):
        self.name = name
        self.script = script
        self.error = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def wait_for(self, predicate, limit=60.0):
        """Polls status until `predicate(status)` holds; returns that status."""
        deadline = threading.Event()
        timer = threading.Timer(limit, deadline.set)
        timer.start()
        status = None
        try:
            while not deadline.is_set() and not self.done.is_set():
                try:
                    status = elastic.status(self.name)
                except RunNotFoundError:
                    status = None
                if status is not None and predicate(status):
                    return status
                self.done.wait(0.02)
        finally:
            timer.cancel()
        why = "the run ended" if self.done.is_set() else f"not within {limit} s"
        raise TimeoutError(f"status of {self.name} never satisfied the condition ({why}); "
                           f"last status: {status}")

    def _run(self):
        try:
            self.script(self)
        except BaseException as e:
            self.error = e
        finally:
            try:
                elastic.stop(self.name)
            except RunNotFoundError:
                pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        if self.error is not None:
            if exc[1] is not None:
                raise self.error from exc[1]  # the run's own error stays in view
            raise self.error


def test_ledger_shows_every_index_once_per_epoch_across_failures_and_a_resize(ray_cluster, tmp_path):
    chaos = (ChaosEvent(step=2, rank=2, action="kill", phase="forward"),
             ChaosEvent(step=9, rank=0, action="kill", phase="optimizer"))
    name = "ledger-run"
    config = _config(tmp_path, max_steps=100_000, chaos=chaos, ledger=True, steps_per_chunk=2,
                     name=name, scaling=ScalingConfig(num_workers=3, min_workers=1, max_workers=4))

    def script(op):
        op.wait_for(lambda s: s["step"] >= 5)
        elastic.scale(name, 4)
        op.wait_for(lambda s: s["world_size"] == 4 and s["step"] >= 3 * PER_EPOCH and s["failures"] == 2)

    with Operator(name, script):
        result = elastic.fit(regression_job(), config)
    assert result.stopped
    _assert_weights_equal_reference(result, result.steps)
    ledger = [json.loads(line) for line in open(os.path.join(result.run_dir, "ledger.jsonl"))]
    assert [entry["step"] for entry in ledger] == list(range(result.steps))
    completed = result.steps // PER_EPOCH
    assert completed >= 3
    for epoch in range(completed):
        seen = [i for entry in ledger if entry["epoch"] == epoch for i in entry["indices"]]
        assert sorted(seen) == list(range(PER_EPOCH * B))  # 96 samples, each exactly once
    assert [f.lost_ranks for f in _events(result, WorkerFailure)] == [[2], [0]]
    assert 4 in {m["world_size"] for m in result.metrics}
    assert _events(result, Resized)


def test_survivors_keep_their_processes_and_a_replacement_restores_the_world_size(
        ray_cluster, tmp_path):
    name = "pid-run"
    config = _config(tmp_path, max_steps=100_000, name=name, steps_per_chunk=2)
    seen = {}

    def script(op):
        before = op.wait_for(lambda s: s["state"] == "running" and s["step"] >= 2)
        seen["before"] = {w["worker_id"]: w["pid"] for w in before["workers"]}
        elastic.kill(name, rank=1)
        seen["killed"] = before["workers"][1]["worker_id"]
        seen["after"] = op.wait_for(
            lambda s: s["failures"] == 1 and s["world_size"] == 4 and s["state"] == "running"
            and s["generation"] >= 2)

    with Operator(name, script):
        result = elastic.fit(regression_job(), config)
    after = {w["worker_id"]: w["pid"] for w in seen["after"]["workers"]}
    survivors = set(seen["before"]) - {seen["killed"]}
    assert len(survivors) == 3
    for worker_id in survivors:
        assert after[worker_id] == seen["before"][worker_id]  # same process, never restarted
    assert seen["killed"] not in after
    assert len(_events(result, WorkerJoined)) == 1
    assert _events(result, WorkerFailure)[0].lost_workers == [seen["killed"]]
    _assert_weights_equal_reference(result, result.steps)


def test_an_injected_user_error_is_retried_and_the_result_is_unchanged(ray_cluster, tmp_path):
    chaos = (ChaosEvent(step=4, rank=2, action="raise", phase="forward"),)
    result = elastic.fit(regression_job(), _config(tmp_path, max_steps=8, chaos=chaos))
    _assert_weights_equal_reference(result, 8)
    errors = _events(result, UserError)
    assert [(e.step, e.ranks, e.attempt) for e in errors] == [(4, [2], 1)]
    assert not _events(result, WorkerFailure)


def test_a_loss_that_always_raises_fails_with_rank_step_and_traceback(ray_cluster, tmp_path):
    config = _config(tmp_path, max_steps=5,
                     failure=elastic.FailureConfig(max_user_retries=2))
    with pytest.raises(UserCodeError) as info:
        elastic.fit(failing_job(), config)
    error = info.value
    assert error.step == 0
    assert error.rank == 0
    assert "user bug in the loss" in error.traceback
    events = read_events(tmp_path / "run")
    assert [e.attempt for e in of_kind(events, UserError)] == [1, 2, 3]
    assert isinstance(events[-1], StateChanged) and events[-1].state == "failed"


def _bias_frozen():
    from tests.jobs import make_model

    model = make_model()
    model[2].bias.requires_grad_(False)
    return model


def _thawing_loss(model, batch):
    """The mse; once the model trained a step (a scheduled unfreezing) the bias trains too."""
    from tests.jobs import mse

    weights = float(model[0].weight.detach().abs().sum())
    if weights != _thawing_loss.first.setdefault(id(model), weights):  # it trained once
        model[2].bias.requires_grad_(True)
    return mse(model, batch)


_thawing_loss.first = {}


def test_a_parameter_that_starts_training_mid_run_fails_the_run_naming_it(ray_cluster, tmp_path):
    # Before, its gradient was never summed over the workers: their weights parted silently.
    from tests.jobs import make_dataset, make_optimizer

    job = elastic.TrainJob(model=_bias_frozen, optimizer=make_optimizer, loss=_thawing_loss,
                           dataset=make_dataset)
    with pytest.raises(elastic.errors.ConfigError, match=r"parameter '2.bias' was frozen when the "
                                                         r"model was built"):
        elastic.fit(job, _config(tmp_path, max_steps=6,
                                 scaling=ScalingConfig(num_workers=2, min_workers=1)))
    events = read_events(tmp_path / "run")
    assert isinstance(events[-1], StateChanged) and events[-1].state == "failed"


def test_scale_outside_the_bounds_is_refused(ray_cluster, tmp_path):
    name = "bounds-run"
    config = _config(tmp_path, max_steps=100_000, name=name)
    errors = []
    done = threading.Event()

    def operator():
        while not done.is_set():
            try:
                elastic.status(name)
                break
            except RunNotFoundError:
                done.wait(0.05)
        try:
            elastic.scale(name, 9)
        except ConfigError as e:
            errors.append(e)
        elastic.stop(name)

    t = threading.Thread(target=operator)
    t.start()
    result = elastic.fit(regression_job(), config)
    done.set()
    t.join()
    assert result.stopped
    assert len(errors) == 1 and "max_workers" in str(errors[0])
    _assert_weights_equal_reference(result, result.steps)


def test_control_calls_on_an_unknown_run_raise_run_not_found(ray_cluster):
    with pytest.raises(RunNotFoundError):
        elastic.status("no-such-run")


def test_free_capacity_is_used_up_to_max_workers(ray_cluster, tmp_path):
    name = "grow-run"
    config = _config(tmp_path, max_steps=100_000, name=name, steps_per_chunk=2,
                     scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=3))

    def script(op):
        op.wait_for(lambda s: s["world_size"] == 3 and s["state"] == "running")

    with Operator(name, script):
        result = elastic.fit(regression_job(), config)
    assert [e.reason for e in _events(result, WorkerStarting)] == ["capacity"]
    assert {m["world_size"] for m in result.metrics} == {2, 3}
    _assert_weights_equal_reference(result, result.steps)


def test_a_stopped_run_resumes_later_at_another_world_size_and_ends_exactly(ray_cluster, tmp_path):
    checkpoint = elastic.CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=4, keep_last=2)
    name = "resume-run"

    def script(op):
        op.wait_for(lambda s: s["step"] >= 5)

    with Operator(name, script):  # stops the run once it is past step 5
        first = elastic.fit(regression_job(), _config(
            tmp_path / "a", max_steps=100_000, checkpoint=checkpoint, name=name))
    assert first.stopped
    stopped_at = first.steps
    assert [e.step for e in _events(first, CheckpointWritten)][-1] == stopped_at
    assert elastic.load_checkpoint(str(tmp_path / "ckpt")).step == stopped_at
    total = stopped_at + 7
    second = elastic.fit(regression_job(), _config(
        tmp_path / "b", max_steps=total, checkpoint=checkpoint,
        scaling=ScalingConfig(num_workers=3, min_workers=1, max_workers=3)))
    assert [e.step for e in _events(second, Resumed)] == [stopped_at]
    assert [m["step"] for m in second.metrics] == list(range(stopped_at, total))
    _assert_weights_equal_reference(second, total)


def test_losing_every_worker_restores_from_the_checkpoint_and_finishes_exactly(ray_cluster, tmp_path):
    # Synchronous writes: the step-6 checkpoint is complete before step 7 starts (an
    # asynchronous one may still be in flight when both workers die at step 7; then the run
    # correctly falls back to step 3).
    checkpoint = elastic.CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=3,
                                          async_write=False)
    chaos = (ChaosEvent(step=7, rank=0, action="kill", phase="backward"),
             ChaosEvent(step=7, rank=1, action="kill", phase="backward"))
    config = _config(tmp_path, max_steps=12, checkpoint=checkpoint, chaos=chaos,
                     scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=2))
    result = elastic.fit(regression_job(), config)
    (restored,) = _events(result, RestoredFromCheckpoint)
    (failure,) = _events(result, WorkerFailure)
    assert restored.step == 6
    # Step 6 ran in a chunk of its own and the kills came in the chunk handed out ahead of
    # it: work lost is what the controller knew committed past the checkpoint, step 6 when
    # an answer for it arrived before both workers died, else nothing.
    assert failure.step in (6, 7) and restored.work_lost_steps == failure.step - 6
    _assert_weights_equal_reference(result, 12)


def test_no_credential_reaches_the_run_record(ray_cluster, tmp_path):
    result = elastic.fit(regression_job(), _config(tmp_path, max_steps=4, ledger=True))
    # Ray's token auth is on: ray.init stored a token in ~/.ray/auth_token unless one came
    # from the environment (RAY_AUTH_TOKEN).
    token_file = pathlib.Path.home() / ".ray" / "auth_token"
    secrets = [token_file.read_text().strip()] if token_file.exists() else []
    secrets += [v for k, v in os.environ.items() if "TOKEN" in k and len(v) >= 8]
    assert secrets, "no Ray auth token found to look for"
    for path in pathlib.Path(result.run_dir).rglob("*"):
        if path.is_file() and path.suffix == ".jsonl":
            text = path.read_text()
            assert not any(secret in text for secret in secrets), path


def test_a_planted_checkpoint_is_skipped_and_the_run_resumes_from_its_own(ray_cluster, tmp_path):
    """Someone who can write the checkpoint folder plants a newer step whose checksums are
    right (they sit beside the files): without the key its manifest cannot be signed, so the
    run resumes from its own newest checkpoint and ends on the reference."""
    import hashlib

    from elastic.checkpoint.store import MANIFEST, serialize, step_dir_name

    root = tmp_path / "ckpt"
    checkpoint = elastic.CheckpointConfig(path=str(root), every_steps=2)
    first = elastic.fit(regression_job(), _config(tmp_path / "a", max_steps=4, checkpoint=checkpoint))
    assert [e.step for e in _events(first, CheckpointWritten)][-1] == 4
    own = json.loads((root / step_dir_name(4) / MANIFEST).read_text())
    planted = root / step_dir_name(50)
    planted.mkdir()
    files = {}
    for name in own["files"]:
        data = (root / step_dir_name(4) / name).read_bytes()
        if name == "model.pt":
            state = torch.load(root / step_dir_name(4) / name, weights_only=True)
            data = serialize({k: torch.zeros_like(v) for k, v in state.items()})
        (planted / name).write_bytes(data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (planted / MANIFEST).write_text(json.dumps({**own, "step": 50, "files": files}))

    second = elastic.fit(regression_job(), _config(tmp_path / "b", max_steps=7, checkpoint=checkpoint))
    skipped = _events(second, CheckpointSkipped)
    assert [e.path for e in skipped] == [step_dir_name(50)]
    assert "does not match" in skipped[0].reason  # its copied signature covers other bytes
    assert [e.step for e in _events(second, Resumed)] == [4]
    _assert_weights_equal_reference(second, 7)
    assert planted.exists()  # never deleted: a wrong key must not cost anyone their data


def test_a_root_of_unsigned_checkpoints_is_not_silently_started_over(ray_cluster, tmp_path):
    """Checkpoints written without signing (an older version, or sign=False): a signing run
    refuses to start over on top of them and says what to set; sign=False resumes from them."""
    root = str(tmp_path / "ckpt")
    unsigned = elastic.CheckpointConfig(path=root, every_steps=2, sign=False)
    elastic.fit(regression_job(), _config(tmp_path / "a", max_steps=4, checkpoint=unsigned))
    with pytest.raises(ConfigError, match=r"none signed with this run's key.*checkpoint\.key_file.*"
                                          r"checkpoint\.sign=False"):
        elastic.fit(regression_job(), _config(tmp_path / "b", max_steps=7,
                                              checkpoint=unsigned.model_copy(update={"sign": True})))
    assert elastic.load_checkpoint(root) is None  # not with the key: unsigned ones are not loaded
    assert elastic.load_checkpoint(root, signed=False).step == 4
    resumed = elastic.fit(regression_job(), _config(tmp_path / "c", max_steps=7, checkpoint=unsigned))
    assert [e.step for e in _events(resumed, Resumed)] == [4]
    _assert_weights_equal_reference(resumed, 7)


def test_a_planted_event_log_is_refused_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("")
    (run_dir / "events.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        elastic.fit(regression_job(), _config(tmp_path, max_steps=2))
    assert victim.read_text() == ""
