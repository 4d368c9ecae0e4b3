"""Checkpoints whose optimizer state is written in shards by its owners
(`elastic.checkpoint.store.write_shard`): a checkpoint counts and loads only once every shard
its manifest lists is written and verifies; loading joins the shards into the whole optimizer
state; a shard that is missing, altered, signed with another key or holding other state is
never loaded; the writer writes its own shard before the manifest and a member's alone."""

from __future__ import annotations

import json
import os

import pytest
import torch

from elastic.checkpoint import CheckpointWriter, load_checkpoint, prune
from elastic.checkpoint.store import (
    has_complete_checkpoint,
    serialize,
    shard_name,
    step_dir_name,
    write_checkpoint,
    write_shard,
)
from elastic.errors import CheckpointCorruptError, CheckpointSignatureError

KEY, OTHER = b"k" * 32, b"o" * 32


def _state(ids: list[int], step: int) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {"exp_avg": torch.full((3,), float(i + step)), "step": torch.tensor(float(step))}
            for i in ids}


LAYOUT = {shard_name(0): [0, 3], shard_name(1): [1], shard_name(2): [2, 4]}


def _write(root: str, step: int, key: bytes | None = KEY, shards=LAYOUT,
           skip: str | None = None) -> None:
    for name, ids in shards.items():
        if name != skip:
            write_shard(root, step, name, serialize(_state(ids, step)), key)
    optimizer = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3, 4]}]}
    write_checkpoint(root, step, {"optimizer": serialize(optimizer),
                                  "model": serialize({"w": torch.ones(2) * step})},
                     {"shards": shards}, key=key)


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
    assert not any(name.startswith("optimizer-shard") for name in loaded.parts)


def test_a_checkpoint_with_a_shard_still_being_written_is_incomplete_until_it_is(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 2)
    _write(root, 4, skip=shard_name(1))  # its owner has not finished
    assert load_checkpoint(root, key=KEY).step == 2
    skipped = load_checkpoint(root, key=KEY).skipped
    assert skipped and "optimizer-shard-00001.json: missing" in skipped[0][1]
    with pytest.raises(CheckpointCorruptError, match="missing"):
        load_checkpoint(root, step=4, key=KEY)
    assert prune(root, keep_last=1, key=KEY) == []  # 4 is not complete: 2 is kept
    write_shard(root, 4, shard_name(1), serialize(_state([1], 4)), KEY)
    assert load_checkpoint(root, key=KEY).step == 4
    assert prune(root, keep_last=1, key=KEY) == [2]


def test_an_incomplete_checkpoint_alone_is_not_complete(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 2, skip=shard_name(2))
    assert not has_complete_checkpoint(root, KEY)
    assert load_checkpoint(root, key=KEY) is None


def test_an_altered_shard_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 2)
    _write(root, 4)
    path = os.path.join(root, step_dir_name(4), f"{shard_name(2)}.pt")
    data = bytearray(open(path, "rb").read())
    data[-20] ^= 1
    open(path, "wb").write(bytes(data))
    loaded = load_checkpoint(root, key=KEY)
    assert loaded.step == 2 and "checksum mismatch" in loaded.skipped[0][1]


def test_a_shard_signed_with_another_key_or_unsigned_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 4)
    write_shard(root, 4, shard_name(1), serialize(_state([1], 4)), OTHER)
    with pytest.raises(CheckpointSignatureError):
        load_checkpoint(root, step=4, key=KEY)
    write_shard(root, 4, shard_name(1), serialize(_state([1], 4)), None)
    with pytest.raises(CheckpointSignatureError):
        load_checkpoint(root, step=4, key=KEY)
    assert not has_complete_checkpoint(root, KEY)


def test_a_shard_holding_other_state_than_listed_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 4)
    write_shard(root, 4, shard_name(1), serialize(_state([1, 2], 4)), KEY)
    with pytest.raises(CheckpointCorruptError, match="other state than the manifest lists"):
        load_checkpoint(root, step=4, key=KEY)
    overlap = {shard_name(0): [0, 1], shard_name(1): [1]}
    _write(root, 6, shards=overlap)
    with pytest.raises(CheckpointCorruptError, match="another shard holds too"):
        load_checkpoint(root, step=6, key=KEY)


def test_a_shard_record_of_another_step_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    _write(root, 4)
    record = os.path.join(root, step_dir_name(4), f"{shard_name(0)}.json")
    other = json.load(open(record))
    other["step"] = 3
    open(record, "w").write(json.dumps(other))
    with pytest.raises(CheckpointCorruptError, match="does not describe this shard"):
        load_checkpoint(root, step=4, key=None)


def test_the_writer_writes_its_shard_before_the_manifest_and_a_members_alone(tmp_path):
    root = str(tmp_path / "ckpt")
    member = CheckpointWriter(root, keep_last=3, key=KEY)
    assert member.submit_shard(2, (shard_name(1), _state([1], 2)))
    member.flush()
    (report,) = member.take_reports()
    assert report.shard == shard_name(1) and report.error is None
    writer = CheckpointWriter(root, keep_last=3, key=KEY)
    order: list[str] = []
    optimizer = {"state": {}, "param_groups": [{"params": [0, 1]}]}
    writer.write_now(2, {"optimizer": optimizer}, {"shards": {shard_name(0): [0],
                                                              shard_name(1): [1]}},
                     after_part=order.append, shard=(shard_name(0), _state([0], 2)))
    assert order == ["optimizer"]
    assert os.path.exists(os.path.join(root, step_dir_name(2), f"{shard_name(0)}.json"))
    loaded = load_checkpoint(root, key=KEY)
    assert sorted(loaded.parts["optimizer"]["state"]) == [0, 1]


def test_a_failed_shard_write_is_reported_with_its_name(tmp_path):
    root = tmp_path / "file"
    root.write_text("not a directory")
    member = CheckpointWriter(str(root), keep_last=3)
    member.write_shard_now(2, (shard_name(3), _state([1], 2)))
    (report,) = member.take_reports()
    assert report.shard == shard_name(3) and report.error.startswith("shard optimizer-shard-00003")
