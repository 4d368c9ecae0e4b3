"""Best-checkpoint retention: the newest keep_last plus the best keep_best by the monitored
metric, decided over plain records and applied to checkpoints on disk (signed and not)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from elastic.checkpoint import CheckpointWriter, load_checkpoint, prune, write_checkpoint
from elastic.checkpoint.retention import Candidate, Retention, best, kept, monitor_record
from elastic.checkpoint.store import MANIFEST, best_checkpoint, list_steps, serialize, step_dir_name

# step -> validation loss recorded by the checkpoint written after that step's evaluation
LOSSES = {2: 0.9, 4: 0.4, 6: 0.7, 8: 0.3, 10: 0.8, 12: 0.5}


def _parts(step: int) -> dict[str, bytes]:
    return {"model": serialize({"w": torch.full((3,), float(step))})}


def _write(root: str, step: int, value: float | None, key: bytes | None = None,
           name: str = "val_loss", mode: str = "min") -> None:
    meta = monitor_record(name, value, mode) if value is not None else {}
    write_checkpoint(root, step, _parts(step), meta, key=key)


def test_kept_is_the_newest_plus_the_best():
    candidates = [Candidate(s, v) for s, v in LOSSES.items()] + [Candidate(13, None)]
    assert kept(candidates, Retention(keep_last=2)) == {13, 12}
    assert kept(candidates, Retention(keep_last=2, keep_best=2, monitor="val_loss")) == {13, 12, 8, 4}
    assert kept(candidates, Retention(keep_last=1, keep_best=1, monitor="val_loss", mode="max")) == {13, 2}
    # The best may be among the newest: nothing more is kept for it.
    assert kept(candidates, Retention(keep_last=3, keep_best=1, monitor="val_loss")) == {13, 12, 10, 8}
    assert kept([], Retention(keep_last=2, keep_best=2, monitor="val_loss")) == set()


def test_ties_keep_the_newer_and_values_that_are_not_finite_are_never_best():
    assert best([Candidate(1, 0.5), Candidate(3, 0.5), Candidate(2, 0.7)], "min", 1) == [3]
    record = monitor_record("loss", math.nan, "min")["monitor"]
    assert record == {"name": "loss", "value": None, "mode": "min"}


@pytest.mark.parametrize("signed", [False, True])
def test_prune_keeps_exactly_the_newest_and_the_best_on_disk(tmp_path, signed):
    key = os.urandom(32) if signed else None
    root = str(tmp_path / "ckpt")
    for step, loss in LOSSES.items():
        _write(root, step, loss, key)
    _write(root, 13, None, key)  # a periodic checkpoint without an evaluation
    _write(root, 1, 0.01, key, name="other")  # another metric: not comparable
    pruned = prune(root, 2, key, Retention(keep_last=2, keep_best=2, monitor="val_loss"))
    assert pruned == [1, 2, 6, 10]
    assert list_steps(root) == [13, 12, 8, 4]
    manifest = json.load(open(os.path.join(root, step_dir_name(8), MANIFEST)))
    assert manifest["monitor"] == {"name": "val_loss", "value": 0.3, "mode": "min"}
    assert best_checkpoint(root, key).step == 8
    assert load_checkpoint(root, key=key).step == 13  # resume still takes the newest


def test_a_planted_checkpoint_cannot_claim_the_best_value(tmp_path):
    key = os.urandom(32)
    root = str(tmp_path / "ckpt")
    for step in (2, 4, 6):
        _write(root, step, LOSSES[step], key)
    _write(root, 5, 0.0001)  # unsigned: planted, or another key
    assert prune(root, 1, key, Retention(keep_last=1, keep_best=1, monitor="val_loss")) == [2]
    assert list_steps(root) == [6, 5, 4]  # the foreign one is neither counted nor deleted
    assert best_checkpoint(root, key).step == 4


def test_the_writer_applies_the_retention_to_synchronous_writes_too(tmp_path):
    root = str(tmp_path / "ckpt")
    writer = CheckpointWriter(root, 1, retention=Retention(1, 1, "val_loss", "max"))
    for step, loss in LOSSES.items():
        writer.write_now(step, _parts(step), monitor_record("val_loss", loss, "max"))
    reports = writer.take_reports()
    assert [r.step for r in reports] == list(LOSSES)
    assert all(r.error is None for r in reports)
    assert list_steps(root) == [12, 2]  # the newest, and the highest value (max)


def test_no_best_checkpoint_without_monitored_ones(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 3, None)
    assert best_checkpoint(root) is None


def test_a_damaged_newer_checkpoint_never_pushes_out_those_the_run_writes_after_it(tmp_path):
    # Step 200's model was damaged without changing its size: the run restored 100 and goes
    # on. Before, retention counted 200 as the newest of keep_last=2: each write deleted the
    # one before it, and with 200 left only one readable checkpoint stayed.
    root = str(tmp_path / "ckpt")
    writer = CheckpointWriter(root, keep_last=2)

    def write(step):
        writer.write_now(step, {"model": {"w": torch.full((3,), float(step))}}, {})
        [report] = writer.take_reports()
        assert report.error is None
        return report.pruned

    write(100), write(200)
    path = os.path.join(root, step_dir_name(200), "model.pt")
    data = bytearray(open(path, "rb").read())
    data[-20] ^= 0xFF
    open(path, "wb").write(bytes(data))
    assert load_checkpoint(root).step == 100
    assert write(150) == () and write(160) == (100,)
    assert list_steps(root) == [200, 160, 150]
    assert write(200) == (150,)  # the run's own write of 200 replaces the damaged one
    assert list_steps(root) == [200, 160] and load_checkpoint(root).step == 200


def test_a_folder_retention_cannot_remove_leaves_the_checkpoint_written(tmp_path, monkeypatch):
    # A step folder held on NFS (or owned by another user): before, every later write was
    # reported failed although committed, and the folders after the stuck one stayed too.
    import fsspec.implementations.local as local

    root = str(tmp_path / "ckpt")
    writer = CheckpointWriter(root, keep_last=1)
    for step in (1, 2):
        writer.write_now(step, _parts(step), {})
    writer.take_reports()
    remove = local.LocalFileSystem.rm

    def stuck(self, path, *args, **kwargs):
        if path.rstrip("/").endswith(step_dir_name(2)):
            raise OSError(39, "Directory not empty")
        return remove(self, path, *args, **kwargs)

    monkeypatch.setattr(local.LocalFileSystem, "rm", stuck)
    writer.write_now(3, _parts(3), {})
    writer.write_now(4, _parts(4), {})
    reports = writer.take_reports()
    assert [(r.step, r.error, r.pruned) for r in reports] == [(3, None, ()), (4, None, (3,))]
    assert all(r.path and "cannot remove step-000000000002: OSError" in r.prune_error
               for r in reports)
    assert list_steps(root) == [4, 2] and load_checkpoint(root).step == 4
