import hashlib
import json
import os
import pickle
from datetime import timedelta

import pytest
import torch

from elastic.checkpoint import CheckpointWriter, load_checkpoint, prune, write_checkpoint
from elastic.checkpoint.store import MANIFEST, list_steps, serialize, step_dir_name
from elastic.errors import CheckpointCorruptError


def _parts(step: int) -> dict[str, bytes]:
    return {"model": serialize({"w": torch.full((64,), float(step))}),
            "cursor": serialize({"global_step": step})}


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "ckpt")
        return
    path = f"memory://ckpt-{os.getpid()}-{id(request)}"
    yield path
    import fsspec

    fs = fsspec.filesystem("memory")
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_written_checkpoints_load_newest_first(root):
    for step in (3, 7):
        write_checkpoint(root, step, _parts(step), {"world_size": 2})
    loaded = load_checkpoint(root)
    assert loaded.step == 7
    assert torch.equal(loaded.parts["model"]["w"], torch.full((64,), 7.0))
    assert loaded.manifest["world_size"] == 2
    assert loaded.skipped == []
    assert load_checkpoint(root, step=3).parts["cursor"] == {"global_step": 3}


def test_rewriting_a_step_leaves_its_checkpoint_whole_until_the_new_one_commits(root):
    # A run resumed (or restored) at step 5 that ends or evaluates there writes step 5 again.
    # Before, the rewrite removed the manifest first: a failed rewrite lost step 5.
    import fsspec

    write_checkpoint(root, 5, _parts(5), {"world_size": 2})

    def crash(name):
        if name == "cursor":
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(root, 5, {"model": serialize({"w": torch.zeros(64)}), "cursor": b"x"},
                         {"world_size": 3}, after_part=crash)
    loaded = load_checkpoint(root)
    assert (loaded.step, loaded.manifest["world_size"]) == (5, 2)
    assert torch.equal(loaded.parts["model"]["w"], torch.full((64,), 5.0))
    write_checkpoint(root, 5, {"model": serialize({"w": torch.ones(64)}),
                               "cursor": serialize({"global_step": 5})}, {"world_size": 3})
    loaded = load_checkpoint(root)
    assert (loaded.step, loaded.manifest["world_size"]) == (5, 3)
    assert sorted(loaded.parts) == ["cursor", "model"]
    assert torch.equal(loaded.parts["model"]["w"], torch.ones(64))
    fs, path = fsspec.core.url_to_fs(root)
    left = sorted(e.rstrip("/").rsplit("/", 1)[-1]
                  for e in fs.ls(f"{path}/{step_dir_name(5)}", detail=False))
    assert left == sorted([MANIFEST, *loaded.manifest["files"]])  # the replaced files are gone
    assert len(left) == 3
    # A manifest (unsigned, edited) that names a file as another's part is refused.
    manifest_path = f"{path}/{step_dir_name(5)}/{MANIFEST}"
    with fs.open(manifest_path, "rb") as f:
        manifest = json.loads(f.read())
    cursor_file = next(n for n, p in manifest["part_names"].items() if p == "cursor")
    manifest["part_names"][cursor_file] = "model"
    with fs.open(manifest_path, "wb") as f:
        f.write(json.dumps(manifest).encode())
    with pytest.raises(CheckpointCorruptError, match="names two files as one part"):
        load_checkpoint(root, step=5)


def test_an_empty_root_has_no_checkpoint(root):
    assert load_checkpoint(root) is None


def _local_file(root, step, name):
    return os.path.join(root, step_dir_name(step), name)


def test_a_truncated_file_is_detected_and_the_previous_checkpoint_used(tmp_path):
    root = str(tmp_path / "ckpt")
    write_checkpoint(root, 1, _parts(1), {})
    write_checkpoint(root, 2, _parts(2), {})
    path = _local_file(root, 2, "model.pt")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    loaded = load_checkpoint(root)
    assert loaded.step == 1
    assert [s for s, _ in loaded.skipped] == [step_dir_name(2)]
    assert "checksum" in loaded.skipped[0][1]


def test_a_flipped_bit_is_detected(tmp_path):
    root = str(tmp_path / "ckpt")
    write_checkpoint(root, 1, _parts(1), {})
    path = _local_file(root, 1, "model.pt")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    assert load_checkpoint(root) is None
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        load_checkpoint(root, step=1)


def test_a_directory_without_manifest_is_an_interrupted_write(tmp_path):
    root = str(tmp_path / "ckpt")
    write_checkpoint(root, 1, _parts(1), {})
    write_checkpoint(root, 2, _parts(2), {})
    os.remove(_local_file(root, 2, MANIFEST))
    loaded = load_checkpoint(root)
    assert loaded.step == 1
    assert "no manifest" in loaded.skipped[0][1]


class _RunsCode:
    def __reduce__(self):
        return (os.makedirs, (os.environ["ELASTIC_TEST_MARKER"],))


# torch warns about the protocol of the tampered pickle before refusing it: expected here.
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_pickle_that_would_run_code_is_refused_and_never_runs(tmp_path, monkeypatch):
    marker = tmp_path / "code-ran"
    monkeypatch.setenv("ELASTIC_TEST_MARKER", str(marker))
    root = str(tmp_path / "ckpt")
    write_checkpoint(root, 5, _parts(5), {})
    # A tampered file whose manifest entry matches, so only the loader stands in the way.
    evil = pickle.dumps(_RunsCode())
    directory = os.path.join(root, step_dir_name(5))
    open(os.path.join(directory, "model.pt"), "wb").write(evil)
    manifest = json.load(open(os.path.join(directory, MANIFEST)))
    manifest["files"]["model.pt"] = {"sha256": hashlib.sha256(evil).hexdigest(), "bytes": len(evil)}
    json.dump(manifest, open(os.path.join(directory, MANIFEST), "w"))
    with pytest.raises(CheckpointCorruptError, match="refused"):
        load_checkpoint(root, step=5)
    assert load_checkpoint(root) is None
    assert not marker.exists()


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                 "memory: you tried to allocate 8589934592 bytes."),
    MemoryError(),
])
def test_a_reader_out_of_memory_is_not_a_corrupt_checkpoint(tmp_path, monkeypatch, error):
    """Skipping it as corrupt would fall back to an older checkpoint, or at a resume with none
    left, start the run over: the allocation failure goes to the caller instead."""
    root = str(tmp_path / "ckpt")
    write_checkpoint(root, 4, _parts(4), {})
    write_checkpoint(root, 5, _parts(5), {})

    def no_room(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "load", no_room)
    with pytest.raises(type(error)):
        load_checkpoint(root)


def test_retention_keeps_the_newest_valid_and_never_the_only_valid_one(tmp_path):
    root = str(tmp_path / "ckpt")
    for step in range(1, 6):
        write_checkpoint(root, step, _parts(step), {})
    assert prune(root, keep_last=2) == [1, 2, 3]
    assert list_steps(root) == [5, 4]
    # Corrupt the newest: the only valid one left (4) survives keep_last=1.
    os.remove(_local_file(root, 5, MANIFEST))
    assert prune(root, keep_last=1) == []
    assert load_checkpoint(root).step == 4


def test_the_writer_says_while_a_write_is_in_flight(tmp_path):
    import threading

    writer = CheckpointWriter(str(tmp_path / "ckpt"), keep_last=5)
    go = threading.Event()
    assert not writer.writing
    assert writer.submit(1, _parts(1), {}, after_part=lambda name: go.wait())
    assert writer.writing  # what a worker marks its steps with (`StepRecord.writing`)
    go.set()
    writer.flush()
    assert not writer.writing and [r.step for r in writer.take_reports()] == [1]


def test_the_writer_never_has_two_writes_in_flight(tmp_path):
    root = str(tmp_path / "ckpt")
    writer = CheckpointWriter(root, keep_last=5)
    big = {"model": serialize({"w": torch.zeros(4_000_000)})}
    assert writer.submit(1, big, {})
    second = writer.submit(2, big, {})
    writer.flush()
    reports = writer.take_reports()
    written = [r.step for r in reports]
    if second:  # the first write had already finished
        assert written == [1, 2]
    else:
        assert written == [1]
    assert all(r.error is None for r in reports)
    assert load_checkpoint(root).step == written[-1]


class _HungStorage:
    """`after_part` that blocks a write once its first part is on disk, as storage that stops
    answering, until `release`."""

    def __init__(self) -> None:
        import threading

        self.hung = threading.Event()
        self._released = threading.Event()

    def __call__(self, _part: str) -> None:
        import threading

        self.thread = threading.current_thread()  # the writer's
        self.hung.set()
        self._released.wait()

    def release(self) -> None:
        """Lets the blocked write go on, and waits for its thread to end (a flush no longer
        waits for a write past its limit)."""
        self._released.set()
        if self.hung.is_set():
            self.thread.join(60)
            assert not self.thread.is_alive()


def test_a_write_past_its_time_limit_is_reported_failed_and_nothing_waits_longer(tmp_path):
    root = str(tmp_path / "ckpt")
    writer = CheckpointWriter(root, keep_last=5, limit_s=60.0)  # writes that must end in time
    assert writer.submit(1, _parts(1), {})
    writer.flush()
    assert [r.step for r in writer.take_reports()] == [1] and load_checkpoint(root).step == 1
    storage = _HungStorage()
    writer.limit_s = 0.05  # the next write's limit
    assert writer.submit(2, _parts(2), {}, after_part=storage)
    writer.limit_s = 60.0
    storage.hung.wait()
    writer.flush()  # returns at the deadline, the write still blocked
    [late] = writer.take_reports()
    assert late.step == 2 and late.path is None and "checkpoint.timeout (0.05 s)" in late.error
    assert root in late.error and writer.busy_note() is not None
    # While it runs on, nothing else is written, asked in the background or at once, and the
    # reason says so; a flush does not wait again and reports nothing twice.
    assert not writer.submit(3, _parts(3), {})
    assert "the write of step 2 has run" in writer.busy_note() and "skipped" in writer.busy_note()
    assert not writer.write_now(4, _parts(4), {})
    writer.flush()
    assert writer.take_reports() == []
    assert load_checkpoint(root).step == 1
    # The storage answers again: the write ends and says so; writing goes on.
    storage.release()
    [ended] = writer.take_reports()
    assert (ended.step, ended.error) == (2, None) and load_checkpoint(root).step == 2
    assert writer.busy_note() is None
    assert writer.write_now(5, _parts(5), {})
    assert [(r.step, r.error) for r in writer.take_reports()] == [(5, None)]
    assert load_checkpoint(root).step == 5


def test_a_shard_write_past_its_time_limit_gives_its_entry_as_an_error(tmp_path):
    from elastic.checkpoint import writer as writer_module

    root = str(tmp_path / "ckpt")
    writer = CheckpointWriter(root, keep_last=5, limit_s=0.05)
    storage = _HungStorage()
    real = writer_module.write_shard

    def hung_shard(*args):
        storage("shard")
        return real(*args)

    writer_module.write_shard, restore = hung_shard, real
    try:
        assert writer.submit_shard(3, "w1", ("shard-0-w1", {"x": torch.ones(2)}))
        assert "checkpoint.timeout" in writer.shard_entry("w1")["error"]
        # The next write's shard cannot start: its entry says why, at once.
        writer.write_shard_now(4, "w2", ("shard-0-w2", {"x": torch.ones(2)}))
        assert "shard of step 4 not written: the write of step 3 has run" \
            in writer.shard_entry("w2")["error"]
    finally:
        writer_module.write_shard = restore
        storage.release()
    assert "sha256" in writer.shard_entry("w1")  # it ended once the storage answered


def test_without_a_time_limit_a_flush_waits_for_the_write(tmp_path):
    import threading

    writer = CheckpointWriter(str(tmp_path / "ckpt"), keep_last=5, limit_s=None)
    storage = _HungStorage()
    assert writer.submit(1, _parts(1), {}, after_part=storage)
    storage.hung.wait()
    flushed = threading.Event()
    waiter = threading.Thread(target=lambda: (writer.flush(), flushed.set()), daemon=True)
    waiter.start()
    assert not flushed.wait(0.2)  # still waiting for the blocked write
    storage.release()
    waiter.join()
    assert flushed.is_set()
    assert [(r.step, r.error) for r in writer.take_reports()] == [(1, None)]


def test_a_load_past_its_time_limit_fails_naming_the_storage_and_the_setting(tmp_path, monkeypatch):
    import threading
    from types import SimpleNamespace

    from elastic.actors import worker as worker_module
    from elastic.checkpoint import store
    from elastic.config import CheckpointConfig
    from elastic.errors import CheckpointTimeoutError

    root = str(tmp_path / "ckpt")
    write_checkpoint(root, 3, _parts(3), {})
    loaded, skipped = store.newest_checkpoint_within(root, None, 5.0)
    assert loaded.step == 3 and skipped == []
    # An error of the read is the caller's, as without a limit.
    def refused(_root):
        raise PermissionError(f"[Errno 13] Permission denied: {_root!r}")

    with monkeypatch.context() as patched:
        patched.setattr(store, "list_steps", refused)
        with pytest.raises(PermissionError, match="Permission denied"):
            store.newest_checkpoint_within(root, None, None)
    released = threading.Event()
    real = store.verify

    def hung(*args):  # storage that stops answering
        released.wait()
        return real(*args)

    monkeypatch.setattr(store, "verify", hung)
    try:
        with pytest.raises(CheckpointTimeoutError) as raised:
            store.newest_checkpoint_within(root, None, 0.05)
        assert root in str(raised.value) and "checkpoint.timeout (0.05 s)" in str(raised.value)
        # The worker's restore asks with the run's setting.
        actor = object.__new__(worker_module.WorkerActor.__ray_metadata__.modified_class)
        actor.config = SimpleNamespace(checkpoint=CheckpointConfig(
            path=root, timeout=timedelta(milliseconds=50)))
        actor.worker_id, actor.device, actor._key, actor._generation = 0, torch.device("cpu"), None, 2
        actor.replica = SimpleNamespace(comm=SimpleNamespace(rank=1))
        actor._compute = SimpleNamespace(run=lambda call: call())  # the step thread: here
        with pytest.raises(CheckpointTimeoutError):
            actor.restore_checkpoint()
    finally:
        released.set()


def test_a_member_whose_shard_write_hangs_has_the_next_checkpoint_skipped_saying_why(
        tmp_path, monkeypatch):
    from types import SimpleNamespace

    from elastic.actors import worker as worker_module
    from elastic.checkpoint import writer as writer_module
    from elastic.config import CheckpointConfig

    root = str(tmp_path / "ckpt")
    storage = _HungStorage()
    real = writer_module.write_shard

    def hung_shard(*args):
        storage("shard")
        return real(*args)

    monkeypatch.setattr(writer_module, "write_shard", hung_shard)
    writer = CheckpointWriter(root, keep_last=5, limit_s=0.05)
    actor = object.__new__(worker_module.WorkerActor.__ray_metadata__.modified_class)
    actor.config = SimpleNamespace(checkpoint=CheckpointConfig(path=root))
    actor.device, actor._writer = torch.device("cpu"), writer
    copies = []
    actor.replica = SimpleNamespace(
        global_step=7, check_committed=lambda: None, unfinished=None,
        shards=SimpleNamespace(rank=1, ownership=None,
                               primary_states=lambda absent: copies.append(1) or {3: {}}))
    actor._compute = SimpleNamespace(run=lambda call: call())  # the step thread: here
    try:
        assert actor.checkpoint_shard("w1")["name"] == "optimizer-shard-00001-w1"
        storage.hung.wait()
        answer = actor.checkpoint_shard("w2")  # the write of w1 is past its limit, still running
        assert answer["step"] == 7 and "name" not in answer and len(copies) == 1  # nothing copied
        assert "the write of step 7 has run" in answer["busy"]
        problem = worker_module._shard_problem([answer], 7, {"optimizer-shard-00000-w2": [0]})
        assert problem.startswith("a member did not write its shard of the optimizer state: "
                                  "the write of step 7 has run")
    finally:
        storage.release()


def test_a_sharded_checkpoint_is_skipped_mid_gather_and_when_ranks_are_missing(tmp_path):
    # A member died while a step's parameters were gathered: the parts a rank does not own
    # are a step behind until the next generation forms, so no shard and no manifest is
    # written then (before the dead were left out, it was skipped only because they never
    # answered). And the writers must be every rank of one generation.
    from types import SimpleNamespace

    from elastic.actors import worker as worker_module
    from elastic.adapt.sharding import Ownership
    from elastic.config import CheckpointConfig

    actor = object.__new__(worker_module.WorkerActor.__ray_metadata__.modified_class)
    actor.config = SimpleNamespace(checkpoint=CheckpointConfig(path=str(tmp_path)))
    actor.device = torch.device("cpu")
    actor._writer = CheckpointWriter(str(tmp_path), keep_last=5)
    ownership = Ownership(owners=((0, 1), (1, 2), (2, 0)), world_size=3)
    shards = SimpleNamespace(rank=1, ownership=ownership,
                             primary_states=lambda absent: pytest.fail("copied"))
    actor.replica = SimpleNamespace(global_step=7, check_committed=lambda: None,
                                    unfinished=lambda: None, shards=shards)
    actor._compute = SimpleNamespace(run=lambda call: call())
    answer = actor.checkpoint_shard("w1", [0])
    assert answer["step"] == 7 and "name" not in answer
    assert "while the parameters of a step were gathered" in answer["busy"]
    problem = worker_module._ranks_problem
    two = [{"rank": 2, "world": 3}]
    assert problem(two, shards, [0]) is None  # ranks 1 and 2 wrote, 0 is dead
    assert "not the ranks of one generation" in problem(two, shards, [])  # 0 forgotten
    assert "not the ranks of one generation" in problem([{"rank": 2, "world": 4}], shards, [0])
    assert problem([], SimpleNamespace(rank=0, ownership=None), []) is None
    # The manifest's writer: a part every owner of which died is named; mid-gather, skipped.
    shards.orphaned = lambda absent: [p for p in range(3)
                                      if ownership.first_alive(p, absent) is None]
    writer_problem = worker_module._writers_problem
    own = {"optimizer-shard-00001-w1": [1]}
    assert "parameter(s) #0 died" in writer_problem(actor.replica, two, 7, own, [0, 1])
    assert "were gathered" in writer_problem(actor.replica, two, 7, own, [0])
    done = SimpleNamespace(shards=shards, unfinished=None)
    answers = [{"step": 7, "name": "optimizer-shard-00002-w1", "ids": [2], "rank": 2,
                "world": 3}]
    assert writer_problem(done, answers, 7, own, [0]) is None
