"""Checkpoints whose optimizer state is written in shards by its owners
(`elastic.checkpoint.store.write_shard`): the manifest, written once every shard is on disk,
lists each with its checksum, so a shard that is altered, replaced by another write's or
missing is never loaded; a write whose shards did not all reach the disk commits nothing;
loading joins the shards into the whole optimizer state; the writer waits for the other
owners' shards before its manifest."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from elastic.checkpoint import CheckpointWriter, load_checkpoint
from elastic.checkpoint.store import (
    has_complete_checkpoint,
    serialize,
    shard_name,
    step_dir_name,
    write_checkpoint,
    write_shard,
)
from elastic.errors import CheckpointCorruptError

KEY = b"k" * 32
LAYOUT = {shard_name(0): [0, 3], shard_name(1): [1], shard_name(2): [2, 4]}


def _state(ids: list[int], step: int) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {"exp_avg": torch.full((3,), float(i + step)), "step": torch.tensor(float(step))}
            for i in ids}


def _optimizer() -> dict:
    return {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3, 4]}]}


def _write(root: str, step: int, shards=LAYOUT, files=None) -> str:
    """Shard 0 is the writer's own file; the others are written by their owners first."""
    entries = {f"{name}.pt": write_shard(root, step, name, serialize(_state(ids, step)))
               for name, ids in shards.items() if name != shard_name(0)}
    parts = {"optimizer": serialize(_optimizer()),
             shard_name(0): serialize(_state(shards[shard_name(0)], step))}
    return write_checkpoint(root, step, parts, {"shards": shards}, key=KEY,
                            written=lambda: entries if files is None else files)


def test_the_shards_are_joined_into_the_whole_optimizer_state(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 4)
    loaded = load_checkpoint(root, key=KEY)
    state = loaded.parts["optimizer"]["state"]
    assert sorted(state) == [0, 1, 2, 3, 4]
    for i in range(5):
        assert torch.equal(state[i]["exp_avg"], torch.full((3,), float(i + 4)))
    assert loaded.parts["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert loaded.manifest["shards"] == LAYOUT
    assert sorted(loaded.manifest["files"]) == sorted(
        ["optimizer.pt", *(f"{name}.pt" for name in LAYOUT)])
    assert not any(name.startswith("optimizer-shard") for name in loaded.parts)


def test_an_altered_or_replaced_shard_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 2)
    directory = _write(root, 4)
    path = os.path.join(directory, f"{shard_name(2)}.pt")
    # Another write's shard of the same name (a stale one, or one planted from elsewhere).
    write_shard(root, 4, shard_name(2), serialize(_state([2, 4], 5)))
    loaded = load_checkpoint(root, key=KEY)
    assert loaded.step == 2 and "checksum mismatch" in loaded.skipped[0][1]
    os.remove(path)
    assert load_checkpoint(root, key=KEY).step == 2
    assert "missing" in load_checkpoint(root, key=KEY).skipped[0][1]


def test_a_write_whose_shards_are_not_all_on_disk_commits_nothing(tmp_path):
    root = str(tmp_path / "ckpt")

    def failed():
        raise RuntimeError("a member's shard of the optimizer state is not on disk (it died)")

    with pytest.raises(RuntimeError, match="it died"):
        write_checkpoint(root, 2, {"optimizer": serialize(_optimizer())},
                         {"shards": {shard_name(1): [1]}}, key=KEY, written=failed)
    assert not has_complete_checkpoint(root, KEY) and load_checkpoint(root, key=KEY) is None


def test_a_shard_holding_other_state_than_listed_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    wrong = {f"{shard_name(1)}.pt": write_shard(root, 4, shard_name(1),
                                                 serialize(_state([1, 2], 4)))}
    write_checkpoint(root, 4, {"optimizer": serialize(_optimizer())},
                     {"shards": {shard_name(1): [1]}}, key=KEY, written=lambda: wrong)
    with pytest.raises(CheckpointCorruptError, match="other state than the manifest lists"):
        load_checkpoint(root, step=4, key=KEY)
    _write(root, 6, shards={shard_name(0): [0, 1], shard_name(1): [1]})
    with pytest.raises(CheckpointCorruptError, match="another shard holds too"):
        load_checkpoint(root, step=6, key=KEY)


def test_a_listed_shard_without_its_file_in_the_manifest_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 4, files={})
    with pytest.raises(CheckpointCorruptError, match="lists shard optimizer-shard-00001 but not"):
        load_checkpoint(root, step=4, key=KEY)


def test_an_owner_named_like_the_writers_files_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="not a new plain name"):
        write_checkpoint(root, 2, {"optimizer": b"x"}, {}, written=lambda: {
            "optimizer.pt": {"sha256": "0", "bytes": 1}})


def test_the_writer_lists_the_owners_shards_once_they_are_on_disk(tmp_path):
    root = str(tmp_path / "ckpt")
    member = CheckpointWriter(root, keep_last=3, key=KEY)
    assert member.submit_shard(2, "w1", (shard_name(1), _state([1], 2)))
    writer = CheckpointWriter(root, keep_last=3, key=KEY)

    def written():
        entry = member.shard_entry("w1")  # waits for the member's write
        return {f"{entry['name']}.pt": entry}

    assert writer.submit(2, {"optimizer": _optimizer(), shard_name(0): _state([0], 2)},
                         {"shards": {shard_name(0): [0], shard_name(1): [1]}}, written=written)
    writer.flush()
    (report,) = writer.take_reports()
    assert report.error is None and report.step == 2
    assert sorted(load_checkpoint(root, key=KEY).parts["optimizer"]["state"]) == [0, 1]
    assert "error" in member.shard_entry("another write")


def test_a_failed_shard_write_fails_the_checkpoint_with_its_reason(tmp_path):
    root = str(tmp_path / "ckpt")
    member = CheckpointWriter(str(tmp_path / "file"), keep_last=3)
    (tmp_path / "file").write_text("not a directory")
    member.write_shard_now(2, "w1", (shard_name(3), _state([1], 2)))
    entry = member.shard_entry("w1")
    assert entry["error"].startswith("shard optimizer-shard-00003")
    writer = CheckpointWriter(root, keep_last=3, key=KEY)

    def written():
        raise RuntimeError(f"a member's shard of the optimizer state is not on disk "
                           f"({entry['error']})")

    writer.write_now(2, {"optimizer": _optimizer()}, {"shards": {}}, written=written)
    (report,) = writer.take_reports()
    assert report.path is None and "optimizer-shard-00003" in report.error
    assert load_checkpoint(root, key=KEY) is None
    shutil.rmtree(root, ignore_errors=True)


def test_the_step_folder_holds_the_owners_files(tmp_path):
    root = str(tmp_path / "ckpt")
    directory = _write(root, 4)
    assert directory.endswith(step_dir_name(4))
    names = sorted(os.listdir(directory))
    assert names == sorted(["MANIFEST.json", "optimizer.pt", *(f"{n}.pt" for n in LAYOUT)])


def test_shards_of_an_earlier_failed_write_of_the_step_go_once_it_commits(tmp_path):
    # A first write of step 4 failed after two members wrote their shards (write id w1);
    # a second (w2) commits the step: retention deletes whole step folders only, so w1's
    # shards would stay as long as the checkpoint.
    root = str(tmp_path / "ckpt")
    for name in (shard_name(1, "w1"), shard_name(2, "w1")):
        write_shard(root, 4, name, serialize(_state([1], 4)))
    layout = {shard_name(0, "w2"): [0, 3], shard_name(1, "w2"): [1], shard_name(2, "w2"): [2, 4]}
    entries = {f"{name}.pt": write_shard(root, 4, name, serialize(_state(ids, 4)))
               for name, ids in layout.items() if name != shard_name(0, "w2")}
    parts = {"optimizer": serialize(_optimizer()),
             shard_name(0, "w2"): serialize(_state(layout[shard_name(0, "w2")], 4))}
    directory = write_checkpoint(root, 4, parts, {"shards": layout}, key=KEY,
                                 written=lambda: entries)
    loaded = load_checkpoint(root, key=KEY)
    assert loaded.step == 4 and sorted(loaded.parts["optimizer"]["state"]) == [0, 1, 2, 3, 4]
    assert sorted(os.listdir(directory)) == sorted(["MANIFEST.json", *loaded.manifest["files"]])
