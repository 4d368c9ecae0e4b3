"""Progress display: what `elastic run` and `elastic.fit` show of a run from its files."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from elastic.events import Planned, StopRequested, WorkerFailure
from elastic.progress import RunProgress, resolve
from elastic.runlog import RunLog


@pytest.mark.parametrize("setting, terminal, otherwise, shown", [
    ("auto", True, None, "bar"), ("auto", False, None, None), ("auto", False, "lines", "lines"),
    ("bar", False, None, "bar"), ("lines", True, None, "lines"), ("off", True, "lines", None),
])
def test_auto_is_a_bar_on_a_terminal_and_otherwise_what_the_caller_says(setting, terminal,
                                                                         otherwise, shown):
    assert resolve(setting, terminal, otherwise) == shown


def _write_run(log: RunLog) -> None:
    log.emit(Planned(dataset_size=320, steps_per_epoch=10, total_steps=20))
    for step in range(20):
        log.metric(step=step, epoch=step // 10, loss=1.0 / (step + 1), samples_per_s=320.0,
                   world_size=4 if step < 12 else 3, time=time.time())
        if step == 11:
            log.emit(WorkerFailure(lost_ranks=[1], step=12, lost_workers=[5], survivors=3,
                                   planned=True, reasons=[""]))


def test_lines_show_the_runs_events_and_a_line_per_tenth_of_its_steps(tmp_path):
    log = RunLog(str(tmp_path))
    log.emit(StopRequested())  # an earlier run's record in the same folder: not this run's
    out = io.StringIO()
    with RunProgress(str(tmp_path), "lines", Console(file=out, width=200, color_system=None)):
        _write_run(log)
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1/20  epoch 0  loss 1  320 samples/s  4 workers"
    assert [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step")] == \
        [1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert "event killed rank 1 on purpose at step 12; 3 survivors go on" in lines
    assert lines.index("event killed rank 1 on purpose at step 12; 3 survivors go on") == \
        lines.index("step 12/20  epoch 1  loss 0.08333  320 samples/s  4 workers") + 1
    assert lines[-1] == "step 20/20  epoch 1  loss 0.05  320 samples/s  3 workers"


def test_the_bar_ends_with_every_step_done_and_the_last_event(tmp_path):
    log = RunLog(str(tmp_path))
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=True, color_system=None)
    with RunProgress(str(tmp_path), "bar", console):
        _write_run(log)
    text = out.getvalue()
    assert "event killed rank 1 on purpose at step 12" in text
    final = text.rsplit("\r", 1)[-1]  # the bar as last drawn
    assert "20/20" in final and "3 workers" in final and "killed rank 1" in final


def test_an_evaluation_line_names_its_step_not_an_epoch_it_may_not_have_ended():
    from elastic.events import Evaluate
    from elastic.progress import describe

    line = describe(Evaluate(step=20, epoch=0, metrics={"mse": 0.123456789, "acc": 1}))
    assert line == "evaluation at step 20 (0 epochs done): acc 1, mse 0.123457"


def test_a_record_a_full_disk_cut_short_is_passed_over_and_the_display_goes_on(tmp_path,
                                                                                 monkeypatch):
    # The run log ends a cut record's line before the next one; before, the display's
    # json.loads raised on it and `fit` ended in a JSONDecodeError.
    import errno

    import elastic.runlog as runlog

    log = RunLog(str(tmp_path))
    out = io.StringIO()
    with RunProgress(str(tmp_path), "lines", Console(file=out, width=200, color_system=None)):
        log.emit(Planned(dataset_size=48, steps_per_epoch=3, total_steps=3))
        log.metric(step=0, epoch=0, loss=0.5, samples_per_s=1.0, world_size=1, time=time.time())
        write = runlog.os.write

        def full(fd, data):
            monkeypatch.setattr(runlog.os, "write", lambda fd, data: (_ for _ in ()).throw(
                OSError(errno.ENOSPC, "No space left on device")))
            return write(fd, data[:7])

        monkeypatch.setattr(runlog.os, "write", full)
        log.metric(step=1, epoch=0, loss=0.25, samples_per_s=1.0, world_size=1, time=time.time())
        monkeypatch.setattr(runlog.os, "write", write)
        log.metric(step=2, epoch=1, loss=0.125, samples_per_s=1.0, world_size=1, time=time.time())
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["1/3", "3/3"]
