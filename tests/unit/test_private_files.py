"""Run files and checkpoints only their owner can read or steer; manifests that cannot be
planted. The machines that run these tests run as root: where a second user is needed, the
test chowns a folder to uid 65534 or runs a reader under it with `setpriv`."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile

import pytest
import torch

from elastic.checkpoint import load_checkpoint, prune, write_checkpoint
from elastic.checkpoint.signing import (
    default_key_file,
    key_id,
    load_or_create_key,
    read_key,
    sign,
    signature_problem,
)
from elastic.checkpoint.store import (
    MANIFEST,
    check_root,
    newest_checkpoint,
    serialize,
    step_dir_name,
)
from elastic.errors import CheckpointCorruptError, CheckpointSignatureError, ConfigError
from elastic.events import StopRequested, read_events
from elastic.private import ensure_private_dir, open_private_append, write_private
from elastic.runlog import RunLog

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a folder to uid 65534")


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _parts(step: int) -> dict[str, bytes]:
    return {"model": serialize({"w": torch.full((3,), float(step))})}


# --- run directories ------------------------------------------------------------------------


def test_run_files_are_0600_in_a_0700_directory(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    log = RunLog(str(run_dir))
    log.event("stop_requested")
    log.metric(step=0, loss=1.0)
    log.ledger(0, 0, [1, 2])
    log.close()
    assert _mode(run_dir) == 0o700
    for name in ("events.jsonl", "metrics.jsonl", "ledger.jsonl"):
        assert _mode(run_dir / name) == 0o600, name
    assert [type(e) for e in read_events(run_dir)] == [StopRequested]


def test_a_symlinked_events_file_is_refused_and_its_target_untouched(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_text("precious\n")
    (run_dir / "events.jsonl").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        RunLog(str(run_dir))
    assert target.read_text() == "precious\n"


def test_a_hard_linked_metrics_file_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    other = tmp_path / "other"
    other.write_text("")
    os.link(other, run_dir / "metrics.jsonl")
    log = RunLog(str(run_dir))
    with pytest.raises(ConfigError, match="hard links"):
        log.metric(step=0)
    assert other.read_text() == ""


@as_root
def test_a_run_directory_of_another_user_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    os.chown(run_dir, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"run_dir '{run_dir}'.*uid {NOBODY}"):
        RunLog(str(run_dir))
    assert not (run_dir / "events.jsonl").exists()


def test_a_group_writable_run_directory_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o775)
    with pytest.raises(ConfigError, match=r"writable by group or others.*chmod go-w"):
        RunLog(str(run_dir))


def test_write_private_replaces_a_planted_link_instead_of_following_it(tmp_path):
    target = tmp_path / "victim"
    target.write_text("precious")
    planted = tmp_path / "final_model.pt"
    planted.symlink_to(target)
    write_private(str(planted), b"weights")
    assert target.read_text() == "precious"
    assert not planted.is_symlink() and planted.read_bytes() == b"weights"
    assert _mode(planted) == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_open_private_append_refuses_a_file_of_another_kind(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError, match="not a regular file"):
        open_private_append(str(tmp_path / "fifo"))


# --- checkpoint roots -----------------------------------------------------------------------


def test_checkpoint_folders_are_0700_and_files_0600(tmp_path):
    root = tmp_path / "ckpt"
    check_root(str(root))
    write_checkpoint(str(root), 4, _parts(4), {}, key=os.urandom(32))
    step_dir = root / step_dir_name(4)
    assert _mode(root) == 0o700 and _mode(step_dir) == 0o700
    assert {p.name: _mode(p) for p in step_dir.iterdir()} == {"model.pt": 0o600, MANIFEST: 0o600}


@as_root
def test_a_checkpoint_root_of_another_user_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"checkpoint.path '{root}'.*uid {NOBODY}"):
        check_root(str(root))


def test_a_world_writable_checkpoint_root_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ConfigError, match=r"checkpoint\.path.*writable by group or others"):
        check_root(str(root))


def test_remote_checkpoint_roots_have_no_local_modes_to_check():
    check_root("memory://private-files-test")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to read as another user")
def test_another_user_cannot_read_the_run_files_or_the_checkpoints():
    # Not under pytest's own folder, which is 0700: the other user must be able to get here.
    top = pathlib.Path(tempfile.mkdtemp(prefix="elastic-private-"))
    try:
        _read_as_another_user(top)
    finally:
        shutil.rmtree(top)


def _read_as_another_user(top: pathlib.Path) -> None:
    base = top / "shared"
    base.mkdir()
    run_dir, root = base / "run", base / "ckpt"
    log = RunLog(str(run_dir))
    log.event("stop_requested")
    log.close()
    write_checkpoint(str(root), 1, _parts(1), {}, key=os.urandom(32))
    write_private(str(run_dir / "final_model.pt"), b"weights")
    control = base / "readable"
    control.write_text("anyone may read this")
    os.chmod(control, 0o644)
    # Only the files' own modes stand in the way: every folder on the way is traversable.
    for folder in (top, base):
        os.chmod(folder, 0o711)
    for p in top.parents:
        if not os.stat(p).st_mode & 0o001:
            pytest.skip(f"{p} is not traversable by others on this machine")

    def read_as_nobody(path) -> subprocess.CompletedProcess:
        return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                               "--clear-groups", "cat", str(path)], capture_output=True, timeout=30)

    assert read_as_nobody(control).returncode == 0  # the test can see a readable file
    for folder in (run_dir, root):
        assert b"Permission denied" in read_as_nobody(folder / "events.jsonl").stderr  # 0700
        os.chmod(folder, 0o711)  # now only the files' 0600 protects them
    os.chmod(root / step_dir_name(1), 0o711)
    for path in (run_dir / "events.jsonl", run_dir / "final_model.pt",
                 root / step_dir_name(1) / "model.pt", root / step_dir_name(1) / MANIFEST):
        result = read_as_nobody(path)
        assert result.returncode != 0 and b"Permission denied" in result.stderr, path


# --- signed manifests -----------------------------------------------------------------------


def _plant(root, step: int, weights: torch.Tensor, signature: dict | None = None) -> None:
    """What someone with write access to the folder does: a step whose manifest checksums
    are right, since they sit beside the files."""
    step_dir = root / step_dir_name(step)
    step_dir.mkdir(parents=True)
    data = serialize({"w": weights})
    (step_dir / "model.pt").write_bytes(data)
    manifest = {"format": 1, "step": step, "created": 0.0,
                "files": {"model.pt": {"sha256": hashlib.sha256(data).hexdigest(),
                                       "bytes": len(data)}}}
    if signature is not None:
        manifest["signature"] = signature
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def test_a_planted_checkpoint_is_skipped_and_never_pruned_in_place_of_a_real_one(tmp_path):
    key = os.urandom(32)
    root = tmp_path / "ckpt"
    for step in (2, 4):
        write_checkpoint(str(root), step, _parts(step), {}, key=key)
    _plant(root, 90, torch.zeros(3))  # unsigned
    real = json.loads((root / step_dir_name(4) / MANIFEST).read_text())
    _plant(root, 95, torch.zeros(3), signature=real["signature"])  # a copied signature
    write_checkpoint(str(root), 99, _parts(99), {}, key=os.urandom(32))  # another key

    loaded = load_checkpoint(str(root), key=key)
    assert loaded.step == 4
    torch.testing.assert_close(loaded.parts["model"]["w"], torch.full((3,), 4.0))
    reasons = dict(loaded.skipped)
    assert list(reasons) == [step_dir_name(s) for s in (99, 95, 90)]
    assert "signed with another key" in reasons[step_dir_name(99)]
    assert "does not match" in reasons[step_dir_name(95)]
    assert "not signed" in reasons[step_dir_name(90)]
    with pytest.raises(CheckpointCorruptError, match="not signed"):
        load_checkpoint(str(root), step=90, key=key)
    # Without a key the planted one would have won: that is what the signature prevents.
    assert load_checkpoint(str(root), key=None).step == 99

    # Retention counts only this key's checkpoints and leaves the others where they are.
    assert prune(str(root), keep_last=1, key=key) == [2]
    assert {p.name for p in root.iterdir()} == {step_dir_name(s) for s in (4, 90, 95, 99)}

    # The three are told apart from damage by type (a resume refuses to start over on them).
    (root / step_dir_name(4) / "model.pt").write_bytes(b"damaged")
    loaded, skips = newest_checkpoint(str(root), key=key)
    assert loaded is None
    assert [(d, type(e)) for d, e in skips] == [
        (step_dir_name(99), CheckpointSignatureError), (step_dir_name(95), CheckpointSignatureError),
        (step_dir_name(90), CheckpointSignatureError), (step_dir_name(4), CheckpointCorruptError)]


def test_an_altered_signed_manifest_is_refused():
    key = os.urandom(32)
    manifest = sign({"format": 1, "step": 3, "files": {}}, key)
    assert signature_problem(manifest, key) is None
    assert "does not match" in signature_problem({**manifest, "step": 4}, key)
    assert "another key" in signature_problem(manifest, os.urandom(32))
    assert manifest["signature"]["key_id"] == key_id(key) and key.hex() not in json.dumps(manifest)


def test_the_key_file_is_created_private_and_read_back(tmp_path):
    path = tmp_path / "keys" / "checkpoint.key"
    key = load_or_create_key(str(path))
    assert len(key) == 32 and load_or_create_key(str(path)) == key == read_key(str(path))
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert default_key_file().startswith(os.environ["ELASTIC_HOME"])


def test_a_key_file_others_can_read_or_a_linked_key_is_refused(tmp_path):
    path = tmp_path / "keys" / "checkpoint.key"
    load_or_create_key(str(path))
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_key(str(path))
    os.chmod(path, 0o600)
    link = tmp_path / "keys" / "link.key"
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="cannot be opened"):
        read_key(str(link))
    with pytest.raises(ConfigError, match="no checkpoint signing key"):
        read_key(str(tmp_path / "missing.key"))


def test_ensure_private_dir_names_the_setting(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"my\.setting"):
        ensure_private_dir(str(tmp_path / "file"), "my.setting")


def test_the_missing_parents_of_a_private_folder_are_private_too(tmp_path):
    # `os.makedirs(mode=0o700)` gives the parents 0777 less the umask: `~/.elastic` was
    # readable by all (it lists run names). A folder that exists is left as it is.
    from elastic.registry import RunRegistry

    os.chmod(tmp_path, 0o755)
    ensure_private_dir(str(tmp_path / "home" / "keys"), "key folder")
    RunRegistry(str(tmp_path / "other" / "runs")).write({"name": "r", "state": "running"})
    for folder in ("home", "home/keys", "other", "other/runs"):
        assert stat.S_IMODE(os.stat(tmp_path / folder).st_mode) == 0o700, folder
    assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o755


@pytest.mark.parametrize("manifest", [
    [],
    {"format": 1, "step": 7, "files": []},
    {"format": 1, "step": 7, "files": {"model.pt": "x"}},
    {"format": 1, "step": 7, "files": {"../model.pt": {"bytes": 1, "sha256": "0"}}},
    {"format": 1, "step": 7, "files": {}, "signature": {"algorithm": "hmac-sha256",
                                                         "key_id": "KEYID", "mac": "\u00e9"}},
    {"format": 1, "step": 7, "files": {}, "signature": {"algorithm": "hmac-sha256",
                                                         "key_id": "KEYID", "mac": 5}},
])
def test_a_malformed_planted_manifest_is_skipped_not_a_crash(tmp_path, manifest):
    key = os.urandom(32)
    root = tmp_path / "ckpt"
    write_checkpoint(str(root), 3, _parts(3), {}, key=key)
    planted = root / step_dir_name(7)
    planted.mkdir()
    text = json.dumps(manifest).replace("KEYID", key_id(key))  # the public id, as an attacker would
    (planted / MANIFEST).write_text(text)
    loaded = load_checkpoint(str(root), key=key)
    assert loaded.step == 3 and [d for d, _ in loaded.skipped] == [step_dir_name(7)]
    assert prune(str(root), keep_last=1, key=key) in ([], [7])  # no exception


def test_a_signed_manifest_with_integer_keyed_metadata_reads_back_valid(tmp_path):
    key = os.urandom(32)
    meta = {"per_rank": {r: r * 2 for r in range(12)}}  # JSON turns 10 before 2
    write_checkpoint(str(tmp_path / "ckpt"), 5, _parts(5), meta, key=key)
    assert load_checkpoint(str(tmp_path / "ckpt"), key=key).step == 5


def test_runs_starting_together_create_one_key(tmp_path):
    import threading

    path = str(tmp_path / "keys" / "checkpoint.key")
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(load_or_create_key(path)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(keys) == 8 and len(set(keys)) == 1
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == ["checkpoint.key"]
