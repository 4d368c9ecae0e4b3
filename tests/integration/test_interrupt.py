"""Ctrl-C on an attached run (`elastic run`, `elastic.fit`): the first stops it as `elastic stop`
does and then raises KeyboardInterrupt (exit code 130 for the CLI); a second one meanwhile
abandons it. Either way its record says how it ended, never `lost`.

SIGINT goes to this process only from a helper thread, once the run is seen training (so the
main thread waits in `fit` for it); each signal is sent on an observable condition, never
after a sleep."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

import elastic
from elastic import BatchConfig, FitConfig, ScalingConfig, TrainJob
from elastic.actors import client
from elastic.errors import RunNotFoundError
from elastic.events import (
    Failed,
    FinalModelFailed,
    FinalModelWritten,
    Finish,
    StopRequested,
    read_events,
)
from tests.events import kinds, of_kind
from tests.head import wait_until
from tests.jobs import make_dataset, make_model, make_optimizer, mse, reference_weights

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
LIMIT_S = 120.0


def _at_step(name: str, step: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            status = elastic.status(name)
        except RunNotFoundError:
            return False
        return status["state"] == "running" and status["step"] >= step
    return check


def _config(tmp_path, name: str) -> FitConfig:
    return FitConfig(scaling=ScalingConfig(num_workers=2), batch=BatchConfig(global_batch_size=16),
                     max_steps=10_000_000, name=name, run_dir=str(tmp_path / name))


def _ctrl_c_from_a_thread(name: str, script: Callable[[Callable[[], None]], None],
                          signum: int = signal.SIGINT) -> list[BaseException]:
    """Runs `script(ctrl_c)` on a thread beside the main thread's `fit`; `ctrl_c()` sends this
    process `signum` (SIGINT, as Ctrl-C does; SIGTERM, as `ray job stop` does). Should
    `script` fail, the run is stopped so that `fit` returns (and the test fails on the error
    returned)."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    errors: list[BaseException] = []

    def run() -> None:
        try:
            script(lambda: os.kill(os.getpid(), signum))
        except BaseException as e:
            errors.append(e)
            elastic.stop(name)

    threading.Thread(target=run, name="ctrl-c", daemon=True).start()
    return errors


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_on_fit_stops_the_run_as_stop_does_then_raises(ray_cluster, tmp_path, capfd,
                                                                         signum):
    name = f"interrupt-fit-{signal.Signals(signum).name.lower()}"
    run_dir = tmp_path / name
    if signum == signal.SIGTERM:  # the weights cannot be written: the line must not name them
        (run_dir / "final_model.pt").mkdir(mode=0o700, parents=True)
        run_dir.chmod(0o700)

    def script(ctrl_c):
        wait_until(_at_step(name, 10), LIMIT_S)
        ctrl_c()

    before = signal.getsignal(signal.SIGTERM)
    errors = _ctrl_c_from_a_thread(name, script, signum)
    stopped = rf"run {name} stopped at step \d+ \(interrupted by (Ctrl-C|SIGTERM)\)"
    expected = pytest.raises(KeyboardInterrupt, match=stopped) if signum == signal.SIGINT else \
        pytest.raises(SystemExit)
    with expected as raised:
        elastic.fit(TrainJob(model=make_model, optimizer=make_optimizer, loss=mse, dataset=make_dataset),
                    _config(tmp_path, name))
    assert not errors, errors
    if signum == signal.SIGTERM:  # the status of a process SIGTERM ended; the line on stderr
        assert raised.value.code == 143
        said = capfd.readouterr().err
        assert re.search(stopped + r"; its final model could not be written to .*final_model.pt "
                         r"\(IsADirectoryError: .*\): its newest checkpoint, if any, holds", said)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler of the wait is gone

    status = elastic.status(name)
    assert status["state"] == "stopped"
    assert status["workers"] == [] and status["ended_at"] >= status["started_at"]
    events = read_events(run_dir)
    order = kinds(events)
    assert StopRequested in order
    if signum == signal.SIGTERM:
        assert FinalModelFailed in order and FinalModelWritten not in order
    else:
        assert FinalModelWritten in order
    finish = of_kind(events, Finish)[-1]
    assert finish.stopped and finish.step == status["step"] >= 10
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == finish.step
    if signum == signal.SIGTERM:
        return
    # The weights the caller could not be returned are in the run dir, exactly the run's.
    model = torch.load(run_dir / "final_model.pt", weights_only=True)
    torch.testing.assert_close(model, reference_weights(0, 16, finish.step), rtol=1e-9, atol=1e-10)


class GatedLoss:
    """mse, except that while the file `hold` exists a step waits in its loss (and says so by
    creating `held`): a stop cannot take effect until the file is gone."""

    def __init__(self, hold: str, held: str) -> None:
        self.hold, self.held = hold, held

    def __call__(self, model, batch):
        while os.path.exists(self.hold):
            pathlib.Path(self.held).touch()
            time.sleep(0.02)
        return mse(model, batch)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_second_ctrl_c_or_sigterm_abandons_the_run_and_records_it_as_interrupted(ray_cluster, tmp_path,
                                                                                   signum):
    name = f"twice-{signal.Signals(signum).name.lower()}"
    run_dir = tmp_path / name
    hold, held = tmp_path / "hold", tmp_path / "held"
    job = TrainJob(model=make_model, optimizer=make_optimizer, loss=GatedLoss(str(hold), str(held)),
                   dataset=make_dataset)
    by, error_type = ("Ctrl-C", "KeyboardInterrupt") if signum == signal.SIGINT else ("SIGTERM", "SystemExit")

    def script(ctrl_c):
        try:
            wait_until(_at_step(name, 5), LIMIT_S)
            hold.touch()
            wait_until(held.exists, LIMIT_S)  # a step waits in its loss: the stop waits for it
            ctrl_c()
            wait_until(lambda: StopRequested in kinds(read_events(run_dir)), LIMIT_S)
            ctrl_c()
        except BaseException:
            hold.unlink(missing_ok=True)
            raise

    errors = _ctrl_c_from_a_thread(name, script, signum)
    try:
        if signum == signal.SIGINT:
            with pytest.raises(KeyboardInterrupt, match="abandoned by a second Ctrl-C"):
                elastic.fit(job, _config(tmp_path, name))
        else:
            with pytest.raises(SystemExit) as raised:
                elastic.fit(job, _config(tmp_path, name))
            assert raised.value.code == 143
    finally:
        hold.unlink(missing_ok=True)
    assert not errors, errors

    status = elastic.status(name)
    assert status["state"] == "failed"  # not lost: it recorded its end before it was killed
    assert status["error_type"] == error_type
    assert f"abandoned by a second {by}" in status["error_message"]
    assert status["workers"] == [] and status["ended_at"] >= status["started_at"]
    assert name in {r["name"] for r in elastic.runs()} - {r["name"] for r in elastic.runs(live_only=True)}
    events = read_events(run_dir)
    assert Finish not in kinds(events)
    assert error_type in of_kind(events, Failed)[-1].error
    assert not (run_dir / "final_model.pt").exists()
    wait_until(lambda: name not in client.live_run_names(), LIMIT_S)  # killed, with its workers


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_on_elastic_run_stops_the_run_and_exits_130_or_143(ray_cluster, tmp_path, signum):
    name = f"interrupt-cli-{signal.Signals(signum).name.lower()}"
    run_dir = tmp_path / name
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        # Its own session: the signal goes to its process group, as a terminal's Ctrl-C does.
        proc = subprocess.Popen(
            [str(BIN / "elastic"), "run", "tests.jobs:regression_job", "--name", name, "--workers", "2",
             "--global-batch", "16", "--max-steps", "10000000", "--run-dir", str(run_dir)],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(_at_step(name, 10), LIMIT_S)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
        else:
            os.kill(proc.pid, signal.SIGTERM)  # `ray job stop`, a scheduler, a container's stop
        code = proc.wait(timeout=LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = out.read_text()
    by = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert code == 128 + signum, output[-3000:]
    assert (f"interrupted ({by}): stopping run {name} after the current step ({by} again to abandon it)"
            in output)
    assert re.search(rf"run {name} stopped at step \d+ \(interrupted by {by}\)", output), output[-3000:]

    status = elastic.status(name)
    assert status["state"] == "stopped" and status["workers"] == []
    events = read_events(run_dir)
    finish = of_kind(events, Finish)[-1]
    assert finish.stopped and finish.step == status["step"]
    assert StopRequested in kinds(events)
    assert (run_dir / "final_model.pt").exists()
