"""metrics.jsonl and ledger.jsonl hold each committed step once, as the run that holds the
weights took it: a run resumed from the checkpoint of step c (a new RunLog on the same run
dir) or restored from one while it runs redoes steps c, c+1, ... and their records replace
the old ones; events.jsonl keeps the whole history. A progress display that follows the
metrics across such a replacement shows only the new records."""

from __future__ import annotations

import json
import os
import stat

import pytest

from elastic.events import Planned, read_jsonl
from elastic.progress import _Tail
from elastic.runlog import RunLog


def _steps(run_dir, name: str) -> list[int]:
    return [r["step"] for r in read_jsonl(os.path.join(run_dir, name))]


def _commit(log: RunLog, step: int, loss: float | None = None) -> None:
    log.metric(step=step, epoch=0, loss=float(step) if loss is None else loss)
    log.ledger(step, 0, [2 * step, 2 * step + 1])


def test_a_resumed_run_replaces_the_records_of_the_steps_it_redoes(tmp_path):
    first = RunLog(str(tmp_path))
    for step in range(10):  # committed 0-9; the checkpoint was at 8 when the driver died
        _commit(first, step)
    first.emit(Planned(dataset_size=24, steps_per_epoch=12, total_steps=12))
    first.close()

    resumed = RunLog(str(tmp_path))
    resumed.emit(Planned(dataset_size=24, steps_per_epoch=12, total_steps=12))
    for step in range(8, 12):
        _commit(resumed, step)
    assert _steps(tmp_path, "metrics.jsonl") == list(range(12))
    assert _steps(tmp_path, "ledger.jsonl") == list(range(12))
    indices = [i for r in read_jsonl(str(tmp_path / "ledger.jsonl")) for i in r["indices"]]
    assert sorted(indices) == list(range(24))  # every sample once
    assert [m["loss"] for m in resumed.metrics] == [8.0, 9.0, 10.0, 11.0]
    for name in ("metrics.jsonl", "ledger.jsonl"):  # still private
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    assert sum(r["event"] == "planned" for r in read_jsonl(str(tmp_path / "events.jsonl"))) == 2


def test_a_restore_during_a_run_replaces_the_steps_redone_in_memory_too(tmp_path):
    log = RunLog(str(tmp_path))
    for step in range(6):
        _commit(log, step)
    for step in range(3, 5):  # restored from the checkpoint of step 3
        _commit(log, step)
    assert _steps(tmp_path, "metrics.jsonl") == [0, 1, 2, 3, 4]
    assert _steps(tmp_path, "ledger.jsonl") == [0, 1, 2, 3, 4]
    assert [m["step"] for m in log.metrics] == [0, 1, 2, 3, 4]


def test_the_per_rank_timeline_is_kept_on_disk_and_for_the_sinks_but_not_in_memory(tmp_path):
    # A long run's controller held every line: 18 KB a step at 64 ranks, three quarters of
    # it the timeline.
    log = RunLog(str(tmp_path))
    seen = []

    class Sink:
        def on_metric(self, record):
            seen.append(record)

        def on_event(self, record):
            pass

    log.add_sinks(Sink())
    timeline = [[1.0, 0.1, 0.2, 0.3, 0.4], None]
    log.metric(step=0, loss=0.5, timeline=timeline)
    assert log.metrics == [{"step": 0, "loss": 0.5}] and log.last_metric() == log.metrics[0]
    assert seen == [{"step": 0, "loss": 0.5, "timeline": timeline}]
    assert read_jsonl(str(tmp_path / "metrics.jsonl")) == seen


def test_a_resume_and_its_follower_read_a_long_runs_metrics_a_line_at_a_time(tmp_path):
    # Before, both held the whole file as records (a resumed 100k-step run at 64 ranks: 2 GB
    # of lines, several times that as dicts) in the controller and in the driver.
    import tracemalloc

    line = json.dumps({"step": 0, "loss": 1.0, "shares": "8" * 4000})
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(3_000):
            f.write(line.replace('"step": 0', f'"step": {step}', 1) + "\n")
    size = os.path.getsize(tmp_path / "metrics.jsonl")
    follower = _Tail(str(tmp_path / "metrics.jsonl"))
    tracemalloc.start()
    try:
        log = RunLog(str(tmp_path))
        assert log.newest_step() == 2_999
        log.metric(step=2_000, loss=0.5)  # resumed from the checkpoint of step 2000
        assert [json.loads(x)["step"] for x in follower.read()] == [2_000]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > 12_000_000 and peak < size / 20
    assert _steps(tmp_path, "metrics.jsonl") == list(range(2_001))
    follower.close()


def test_a_run_that_only_appends_never_rewrites_its_files(tmp_path):
    log = RunLog(str(tmp_path))
    _commit(log, 0)
    inode = os.stat(tmp_path / "metrics.jsonl").st_ino
    for step in range(1, 5):
        _commit(log, step)
    assert os.stat(tmp_path / "metrics.jsonl").st_ino == inode


def test_a_follower_of_the_metrics_sees_only_this_runs_records_across_a_replacement(tmp_path):
    earlier = RunLog(str(tmp_path))
    for step in range(10):
        _commit(earlier, step)
    earlier.close()
    tail = _Tail(str(tmp_path / "metrics.jsonl"))  # started with the resumed run: skips 0-9
    resumed = RunLog(str(tmp_path))
    _commit(resumed, 8, loss=-8.0)  # the redone step's own record
    _commit(resumed, 9, loss=-9.0)
    assert [json.loads(line)["loss"] for line in tail.read()] == [-8.0, -9.0]
    _commit(resumed, 10)
    assert len(tail.read()) == 1 and tail.read() == []


def test_a_lost_run_shows_the_steps_it_committed_and_no_workers(tmp_path):
    from elastic.registry import LOST, mark_lost

    log = RunLog(str(tmp_path))
    for step in range(10):  # committed 0-9; the record was last published at step 8
        _commit(log, step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 10, "epo')  # a line still being written when the process died
    record = {"name": "r", "state": "running", "step": 8, "run_dir": str(tmp_path),
              "workers": [{"rank": 0, "worker_id": "w", "pid": 1, "node_id": "n"}], "joining_workers": 1}
    lost = mark_lost(record)
    assert (lost["state"], lost["step"], lost["workers"], lost["joining_workers"]) == (LOST, 10, [], 0)
    assert mark_lost({**record, "run_dir": str(tmp_path / "gone")})["step"] == 8
    # The lines of an earlier run in a reused run dir (written before this run started) do not count.
    assert mark_lost({**record, "started_at": 1e12})["step"] == 8
    assert mark_lost({**record, "run_dir": None})["step"] == 8


def test_a_follower_sees_the_new_records_across_two_replacements_between_reads(tmp_path):
    """Two rewrites between reads could hand the freed inode back to the second file; the
    follower holds the file it reads open, so it notices the replacement all the same."""
    log = RunLog(str(tmp_path))
    for step in range(10):
        _commit(log, step)
    tail = _Tail(str(tmp_path / "metrics.jsonl"))
    for step in range(5, 7):  # restored from step 5
        _commit(log, step, loss=-float(step))
    for step in range(5, 10):  # and from step 5 again
        _commit(log, step, loss=-10.0 - step)
    assert [json.loads(line)["loss"] for line in tail.read()] == [-15.0, -16.0, -17.0, -18.0, -19.0]
    tail.close()



def test_a_record_torn_by_a_crash_is_passed_over_and_the_next_run_starts_a_new_line(tmp_path):
    # A full disk or a host that went down mid-write left half a record; a resumed run then
    # appended after it. Before, the glued line made every later read raise: the next
    # resume, `elastic logs`, the run's own supersede of redone steps.
    earlier = RunLog(str(tmp_path))
    for step in range(3):
        earlier.metric(step=step, loss=1.0)
    earlier.close()
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')  # torn
    later = RunLog(str(tmp_path))
    assert later.newest_step() == 2
    later.metric(step=3, loss=0.5)
    later.close()
    assert [r["step"] for r in read_jsonl(str(path))] == [0, 1, 2, 3]
    with open(path, "a") as f:
        f.write('{"step": 4, "lo\n{"step": 5}\n')  # a torn line in the middle
    assert [r["step"] for r in read_jsonl(str(path))] == [0, 1, 2, 3, 5]


def test_a_full_disk_loses_records_from_the_files_not_the_run(tmp_path, monkeypatch):
    # Before, the OSError ended the run as a controller bug ("ControllerError: OSError").
    import errno

    import elastic.runlog as runlog

    log = RunLog(str(tmp_path))
    _commit(log, 0)
    write, calls = os.write, []

    def full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return write(fd, data[:7])  # part of the line, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runlog.os, "write", full)
    log.metric(step=1, epoch=0, loss=1.0)
    log.emit(Planned(dataset_size=24, steps_per_epoch=12, total_steps=12))
    monkeypatch.setattr(runlog.os, "write", write)  # space again
    log.metric(step=2, epoch=0, loss=2.0)
    assert [m["step"] for m in log.metrics] == [0, 1, 2]
    assert [e["event"] for e in log.events] == ["planned"]
    assert _steps(tmp_path, "metrics.jsonl") == [0, 2]  # the cut line is passed over
    assert read_jsonl(str(tmp_path / "events.jsonl")) == []


def test_a_full_disk_as_an_earlier_runs_torn_line_is_ended_glues_nothing_onto_it(tmp_path,
                                                                                   monkeypatch):
    import errno

    import elastic.runlog as runlog

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo')
    os.chmod(tmp_path / "metrics.jsonl", 0o600)
    log = RunLog(str(tmp_path))
    write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runlog.os, "write", full)
    log.metric(step=1, loss=0.5)  # the newline that ends the torn record fails, and this one
    monkeypatch.setattr(runlog.os, "write", write)
    log.metric(step=2, loss=0.25)
    assert _steps(tmp_path, "metrics.jsonl") == [0, 2]


@pytest.mark.timeout(60)
def test_status_reads_and_other_threads_events_do_not_wait_for_a_rewrite(tmp_path,
                                                                          monkeypatch):
    # A resumed run's first metric rewrites metrics.jsonl (gigabytes on a long run): before,
    # under the lock a status read and every event take, so a controller busy rewriting did
    # not answer `elastic status` in 10 s and its run read as lost.
    import threading

    from elastic import runlog
    from elastic.events import StopRequested

    first = RunLog(str(tmp_path))
    for step in range(10):
        _commit(first, step)
    first.close()
    log = RunLog(str(tmp_path))
    log.metric(step=3, epoch=0, loss=3.0)  # a resume at step 3: the rewrite is done once
    entered, release = threading.Event(), threading.Event()
    write = runlog.write_private

    def slow_write(path, data):
        entered.set()
        release.wait()
        return write(path, data)

    monkeypatch.setattr(runlog, "write_private", slow_write)
    redo = threading.Thread(target=log.metric, kwargs={"step": 2, "epoch": 0, "loss": 2.0})
    redo.start()  # restored from the checkpoint of step 2 while it runs
    assert entered.wait(30)
    assert log.last_metric()["step"] == 3  # neither waits for the rewrite
    log.emit(StopRequested())
    release.set()
    redo.join()
    assert _steps(tmp_path, "metrics.jsonl") == [0, 1, 2]
    assert [r["event"] for r in read_jsonl(tmp_path / "events.jsonl")][-1] == "stop_requested"


def test_the_controller_keeps_the_newest_metrics_records_the_setting_asks_for(tmp_path):
    """`LoggingConfig.result_metrics`: a long run's every record stayed in the controller's
    memory (about 2 KB a step at 64 workers) and went to the caller whole; the newest are
    kept, at most an eighth more between trims, and metrics.jsonl has every one."""
    from elastic.runlog import iter_jsonl

    log = RunLog(str(tmp_path), metrics_kept=8)
    for step in range(30):
        log.metric(step=step, loss=float(step))
    assert 8 <= len(log.metrics) <= 9 and log.metrics[-1]["step"] == 29
    assert [m["step"] for m in log.newest_metrics()] == list(range(22, 30))
    assert [r["step"] for r in iter_jsonl(str(tmp_path / "metrics.jsonl"))] == list(range(30))
    log.metric(step=25, loss=0.0)  # a restore redid step 25: the later records go
    assert [m["step"] for m in log.metrics][-1] == 25
    everything = RunLog(str(tmp_path / "all"))
    for step in range(30):
        everything.metric(step=step)
    assert len(everything.metrics) == 30
