"""Loader processes (no Ray): a piece read ahead is the same bits, generators included, as one
read in the worker; pieces of another plan are dropped; a data set error comes back with its
traceback; loader processes never outlive the worker, however it ends."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections import OrderedDict, UserDict, defaultdict, namedtuple

import pytest
import torch
from torch.utils.data import default_collate

from elastic.trainer.loader import LoadError, Piece, generator_state, load_piece
from tests import fidelity, jobs
from tests.head import wait_until
from tests.procs import alive, wait_gone
from tests.unit.test_split_independence import SCHEDULES, SEED, B, G, _elastic

pytestmark = pytest.mark.timeout(120)


def faulty_job():
    return jobs.corrupt_job()






def test_a_piece_read_ahead_is_the_piece_read_here_generators_included(prefetcher):
    job = fidelity.augmented_job()
    loader = prefetcher(job)
    pieces = [Piece(3, 11, (5, 1, 9)), Piece(3, 12, (4, 60)), Piece(4, 13, (0,))]
    loader.want(pieces)
    for piece in pieces:
        batch, state = loader.take(piece)
        expected = load_piece(job.dataset(), default_collate, piece.indices, piece.seed)
        after = generator_state()
        assert all(torch.equal(a, b) for a, b in zip(batch, expected, strict=True))
        assert torch.equal(state[0], after[0])  # torch's generator where reading left it
        assert state[1] == after[1]  # Python's
        assert state[2][0] == after[2][0] and (state[2][1] == after[2][1]).all()  # NumPy's


def test_pieces_of_another_plan_are_dropped_and_read_here_instead(prefetcher):
    loader = prefetcher(fidelity.augmented_job(), workers=1)
    old, new = Piece(0, 1, (1, 2)), Piece(0, 1, (1, 3))
    loader.want([old])
    loader.want([new])  # a replan: the old piece must never be handed out
    assert loader.take(old) is None
    assert loader.take(new) is not None
    assert loader.take(new) is None  # taken once; a redo of the step reads it again itself


def test_a_data_set_error_in_a_loader_carries_its_traceback(prefetcher):
    loader = prefetcher(faulty_job(), workers=1)
    bad = Piece(2, 5, (3, 7))
    loader.want([bad, Piece(2, 6, (1,))])
    with pytest.raises(LoadError) as info:
        loader.take(bad)
    message = str(info.value)
    assert "step 2" in message and "ValueError: sample 7 is corrupt" in message
    assert "in __getitem__" in message  # the loader's own traceback, not ours
    assert loader.take(Piece(2, 6, (1,))) is not None  # the loaders go on


def test_a_killed_loader_process_is_an_error_of_that_piece_then_loaders_restart(prefetcher):
    loader = prefetcher(fidelity.augmented_job(), workers=1)
    loader.want([Piece(0, 1, (1,))])
    assert loader.take(Piece(0, 1, (1,))) is not None
    [pid] = loader.pids()
    os.kill(pid, signal.SIGKILL)
    assert wait_gone([pid]) == []
    loader.want([Piece(1, 1, (2,))])
    # The death may be seen at the `want` (the loader is replaced before the piece is sent,
    # and the new one reads it) or at the `take` (the piece fails as "died", and is never sent
    # to a loader again: the worker reads it itself, so a piece that crashes its reader cannot
    # crash one loader after another); either way the next piece is read by a new loader.
    try:
        assert loader.take(Piece(1, 1, (2,))) is not None
    except LoadError as e:
        assert "died" in str(e)
        loader.want([Piece(1, 1, (2,))])
        assert loader.take(Piece(1, 1, (2,))) is None
    loader.want([Piece(2, 1, (3,))])
    assert loader.take(Piece(2, 1, (3,))) is not None
    assert loader.pids() and pid not in loader.pids()


class _FakePin:
    """`elastic.trainer.loader.pin_batch` on a machine without CUDA: records which thread pinned
    which piece's batch (told apart by their samples), in one order with the test's own notes,
    and returns it marked as pinned; raises for the piece `fail`."""

    def __init__(self, job, pieces: list[Piece], fail: Piece | None = None,
                 hold: Piece | None = None) -> None:
        self.expected = {p: load_piece(job.dataset(), default_collate, p.indices, p.seed)
                         for p in pieces}
        self.events: list[tuple[str, Piece, str]] = []
        self.fail = fail
        self.hold, self.release = hold, threading.Event()  # pinning `hold` waits for release
        self.lock = threading.Lock()

    def note(self, what: str, piece: Piece) -> None:
        with self.lock:
            self.events.append((what, piece, threading.current_thread().name))

    def __call__(self, batch):
        [piece] = [p for p, b in self.expected.items()
                   if all(torch.equal(x, y) for x, y in zip(batch, b, strict=True))]
        self.note("pinned", piece)
        if piece == self.hold:
            assert self.release.wait(60), "the test never released the pinning thread"
        if piece == self.fail:
            raise RuntimeError("CUDA error: out of memory (pinning)")
        return ("pinned", batch)

    def pinned(self, piece: Piece) -> bool:
        with self.lock:
            return any(e[:2] == ("pinned", piece) for e in self.events)


def test_batches_are_pinned_on_a_thread_of_their_own_as_they_arrive(prefetcher, monkeypatch):
    """`pin_memory`: a batch is pinned once received, on the loader's pinning thread, while
    the step goes on; `take` hands out the pinned batch (the same samples, generators
    included), a pinning error is the step's, a dropped piece is never handed out, and close
    ends the pinning thread."""
    from elastic.trainer import loader as loader_module

    job = fidelity.augmented_job()
    pieces = [Piece(0, 1, (5, 1)), Piece(1, 2, (9, 3)), Piece(2, 3, (40,)), Piece(3, 4, (7,)),
              Piece(9, 9, (11,))]
    fake = _FakePin(job, pieces, fail=pieces[2])
    monkeypatch.setattr(loader_module, "pin_batch", fake)
    loader = prefetcher(job, workers=1, pin_memory=True)
    loader.want(pieces[:4])
    first = loader.take(pieces[0])
    fake.note("taken", pieces[0])
    # The next piece is pinned without the step asking for it: `want` (each step's start)
    # receives it, and the pinning thread copies it.
    wait_until(lambda: loader.want(pieces[1:]) or fake.pinned(pieces[1]), limit=60)
    fake.note("taking", pieces[1])
    second = loader.take(pieces[1])
    for piece, (batch, state) in zip(pieces, (first, second), strict=False):
        assert batch[0] == "pinned"
        assert all(torch.equal(a, b) for a, b in zip(batch[1], fake.expected[piece], strict=True))
        load_piece(job.dataset(), default_collate, piece.indices, piece.seed)
        assert torch.equal(state[0], generator_state()[0])  # generators as read here
    order = [e for e in fake.events if e[1] == pieces[1]]
    assert [e[0] for e in order] == ["pinned", "taking"]  # pinned before it was asked for
    assert order[0][2].startswith("elastic-pin") and order[1][2] == threading.current_thread().name
    with pytest.raises(RuntimeError, match="out of memory \\(pinning\\)"):
        loader.take(pieces[2])  # its pinning failed: the step's error, as pinning here was
    loader.want([pieces[4]])  # a replan: piece 3 is dropped, pinned or not
    assert loader.take(pieces[3]) is None
    assert loader.take(pieces[4])[0][0] == "pinned"
    loader.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("elastic-pin")]


def test_a_piece_dropped_before_its_turn_to_be_pinned_is_never_pinned(prefetcher, monkeypatch):
    """A replan drops the pieces read ahead for the old plan: those still waiting for the
    pinning thread are never copied (the thread would otherwise pin them before the pieces
    now wanted)."""
    from elastic.trainer import loader as loader_module

    job = fidelity.augmented_job()
    pieces = [Piece(0, 1, (5, 1)), Piece(1, 2, (9, 3)), Piece(2, 3, (40,))]
    fake = _FakePin(job, pieces, hold=pieces[0])
    monkeypatch.setattr(loader_module, "pin_batch", fake)
    loader = prefetcher(job, workers=1, pin_memory=True)
    # The pinning thread is held in piece 0's copy while pieces 1 and 2 arrive behind it.
    wait_until(lambda: loader.want(pieces) or all(p in loader._ready for p in pieces), limit=60)
    loader.want(pieces[:2])  # a replan: piece 2 is dropped while queued
    fake.release.set()
    assert loader.take(pieces[0])[0][0] == loader.take(pieces[1])[0][0] == "pinned"
    loader.close()
    assert [e[1] for e in fake.events if e[0] == "pinned"] == pieces[:2]


def test_close_leaves_no_loader_process(prefetcher):
    loader = prefetcher(fidelity.augmented_job())
    loader.want([Piece(0, 1, (1,))])
    loader.take(Piece(0, 1, (1,)))
    pids = loader.pids()
    assert len(pids) == 2
    loader.close()
    assert wait_gone(pids, timeout=5) == []


_OWNER = textwrap.dedent("""
    import sys, torch
    from elastic.trainer.loader import Piece, Prefetcher
    from tests import fidelity
    if __name__ == "__main__":
        loader = Prefetcher(fidelity.augmented_job(), 2, "spawn", torch.get_rng_state())
        loader.want([Piece(0, 1, (1,))])
        loader.take(Piece(0, 1, (1,)))
        print(*loader.pids(), flush=True)
        sys.stdin.read()  # until killed
""")


def test_loader_processes_exit_when_their_worker_is_sigkilled(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    owner = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=root,
                             env={**os.environ, "PYTHONPATH": root})
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        owner.kill()  # SIGKILL: no cleanup code runs in the owner
        owner.wait()
        assert wait_gone(pids) == []
    finally:
        owner.kill()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["kill", "resize"])
def test_an_elastic_run_reading_ahead_ends_on_the_reference(tmp_path, schedule):
    """Dropout and augmentation drawn from torch's, Python's and NumPy's generators in loader
    processes: the plain-PyTorch reference (everything read in one process) to float tolerance,
    and every member alike."""
    job = fidelity.augmented_job()
    # Each generation starts fresh replicas, each with a loader process (a spawn and torch's
    # import): a resize of one step up keeps the test to two generations.
    schedules = {**SCHEDULES, "resize": [(2, 3, None), (3, 3, [1.0, 2.0, 1.0])]}
    final = _elastic(tmp_path, job, schedules[schedule], loader_workers=1)
    expected = fidelity.reference(job, SEED, B, G, 6)
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)


def test_the_reference_sees_augmentation_that_is_not_reseeded(tmp_path):
    """The oracle can fail: without seeding Python's and NumPy's generators per group the
    augmented run ends elsewhere."""
    import random

    import numpy as np

    job = fidelity.augmented_job()
    expected = fidelity.reference(job, SEED, B, G, 6)
    real = fidelity.seed_all
    try:
        fidelity.seed_all = lambda seed: torch.manual_seed(seed)  # torch only, as before
        random.seed(1)
        np.random.seed(1)
        other = fidelity.reference(job, SEED, B, G, 6)
    finally:
        fidelity.seed_all = real
    assert max(float((other[k] - expected[k]).abs().max()) for k in expected) > 1e-4


def test_steps_train_on_the_pieces_the_loaders_read(tmp_path):
    """The pieces really come from the loader processes (a step that read them itself would
    pass the reference test too): every piece of 4 steps after the first was served."""
    from elastic import BatchConfig, DataConfig, FitConfig, ScalingConfig
    from elastic.adapt.plan import plan_batch
    from elastic.collective import RendezvousServer
    from elastic.trainer.replica import Replica, StepRecord
    from tests.threads import run_ranks

    config = FitConfig(scaling=ScalingConfig(num_workers=1), max_steps=10, seed=SEED,
                       batch=BatchConfig(global_batch_size=B, autotune=False, rebalance=False),
                       data=DataConfig(loader_workers=2, prefetch_steps=2), run_dir=str(tmp_path))
    plan = plan_batch(B, 1, G, None, unit=G)

    def body(comm):
        replica = Replica(fidelity.augmented_job(), config, str(tmp_path))
        replica.comm = comm
        try:
            for _ in range(5):
                assert isinstance(replica.run_step(plan, []), StepRecord)
            prefetcher = replica.prefetcher
            # Each piece given to the loaders once: 5 steps and the 2 read ahead.
            assert prefetcher.submitted == (5 + 2) * (B // G)
            return prefetcher.served, replica.model.state_dict()
        finally:
            replica.close()

    server = RendezvousServer()
    try:
        [(served, state)] = run_ranks(server, 1, body)
    finally:
        server.close()
    assert served == 5 * (B // G)
    expected = fidelity.reference(fidelity.augmented_job(), SEED, B, G, 5)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-5, msg=key)


# --- what the pinning thread does to a batch's containers ------------------------------------


class _Encoding(UserDict):
    """Hugging Face's `BatchEncoding` is a `UserDict` with attributes of its own."""

    def __init__(self, data, tag: str) -> None:
        super().__init__(data)
        self.tag = tag


@dataclasses.dataclass(frozen=True)
class _Sample:
    x: torch.Tensor
    name: str


class _Tagged(list):
    def __init__(self, items, tag: str) -> None:
        super().__init__(items)
        self.tag = tag


_Pair = namedtuple("_Pair", ["x", "y"])


def test_pinning_keeps_every_container_and_pins_every_tensor_in_it(monkeypatch):
    """Pinned in the containers `move_batch` takes, with their types and attributes (before,
    a `UserDict` such as `BatchEncoding` or a dataclass was left unpinned, an OrderedDict
    became a dict and a list subclass raised)."""
    from elastic.trainer import loader as loader_module

    pinned: set[int] = set()

    def pin(self, *args, **kwargs):  # no CUDA here: a copy, remembered as page-locked
        out = self.clone()
        pinned.add(id(out))
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    t = torch.arange(3.0)
    batch = {"ordered": OrderedDict(a=t), "default": defaultdict(list, b=t),
             "encoding": _Encoding({"input_ids": t}, "fast"), "sample": _Sample(t, "s"),
             "pair": _Pair(t, [t, 1]), "tagged": _Tagged([t, "x"], "y"), "text": "hello"}
    out = loader_module.pin_batch(batch)
    assert type(out["ordered"]) is OrderedDict and type(out["default"]) is defaultdict
    assert type(out["encoding"]) is _Encoding and out["encoding"].tag == "fast"
    assert type(out["sample"]) is _Sample and out["sample"].name == "s"
    assert type(out["pair"]) is _Pair and type(out["tagged"]) is _Tagged
    assert out["tagged"].tag == "y" and out["tagged"][1] == "x" and out["text"] == "hello"
    leaves = [out["ordered"]["a"], out["default"]["b"], out["encoding"]["input_ids"],
              out["sample"].x, out["pair"].x, out["pair"].y[0], out["tagged"][0]]
    assert all(id(x) in pinned and torch.equal(x, t) for x in leaves)
    assert batch["encoding"]["input_ids"] is t  # the batch itself is left as it was


class _Odd(tuple):
    """A tuple subclass that cannot be rebuilt from its items."""

    def __new__(cls, a, b, tag):
        return super().__new__(cls, (a, b, tag))


def test_a_batch_pinning_cannot_rebuild_is_left_as_it_is(monkeypatch):
    """The job's own `move_batch` may know the container; before, the pinning thread's error
    failed the step."""
    from elastic.trainer import loader as loader_module

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self.clone())
    batch = _Odd(torch.ones(2), torch.zeros(2), "x")
    assert loader_module.pin_batch(batch) is batch


def test_without_loader_processes_the_worker_pins_each_batch_it_reads(monkeypatch):
    """`data.pin_memory` with `loader_workers=0` on a GPU worker: each micro-batch pinned as it
    is read, as `DataLoader(num_workers=0, pin_memory=True)` does (before, nothing was
    pinned); a tensor the data set already put on a device is left there."""
    from types import SimpleNamespace

    from elastic.trainer import loader as loader_module
    from elastic.trainer.compute import load

    pinned: list[tuple[int, ...]] = []

    def pin(self, *args, **kwargs):  # no CUDA here: a copy, noted
        pinned.append(tuple(self.shape))
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    dataset = jobs.make_dataset()
    moved: list = []
    for gpu in (True, False):
        host = SimpleNamespace(
            prefetcher=None, dataset=dataset, collate=default_collate,
            config=SimpleNamespace(data=SimpleNamespace(pin_memory=True),
                                  batch=SimpleNamespace(exact=False)),
            device=torch.device("cuda" if gpu else "cpu"),
            move=lambda batch, device: moved.append(batch) or batch)
        load(host, 0, 1, torch.tensor([3, 1, 4]))
    assert pinned == [(3, 6), (3, 1)]  # the GPU worker's batch only: x and y
    meta = torch.empty(2, device="meta")  # already on a device: not pinned
    assert loader_module.pin_batch([meta])[0] is meta


def test_a_batch_page_locked_memory_has_no_room_for_is_used_unpinned_and_said_once(monkeypatch,
                                                                                  caplog):
    """`cudaHostAlloc` failing (the batches read ahead hold the locked memory, or the host's
    limit) ended the step as the user's error; training goes on with a pageable copy."""
    from elastic.trainer import loader as loader_module

    def pin(self, *args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(loader_module, "_unpinned_said", False)
    batch = [torch.ones(2), torch.zeros(2)]
    with caplog.at_level("WARNING", logger="elastic.trainer.loader"):
        assert loader_module.pin_batch(batch) is batch
        assert loader_module.pin_batch(batch) is batch
    said = [r for r in caplog.records if "could not be pinned" in r.getMessage()]
    assert len(said) == 1 and "out of memory" in said[0].getMessage()


def test_a_data_set_drawn_from_python_and_numpy_is_the_same_on_every_rank_and_loader(
        prefetcher):
    # Python's and NumPy's generators differ from process to process: a factory that draws
    # from them built another data set on each rank (index i, another sample on each: some
    # samples twice, some never) and in each loader process. Now they are seeded from torch's
    # state, which every rank builds the data set under.
    import random

    import numpy as np

    from elastic import BatchConfig, FitConfig, ScalingConfig
    from elastic.trainer.build import built_data

    job = jobs.shuffled_job()
    config = FitConfig(scaling=ScalingConfig(num_workers=2), max_steps=4,
                       batch=BatchConfig(global_batch_size=16))
    built = []
    for other in (1, 2):
        torch.manual_seed(SEED)
        random.seed(other)
        np.random.seed(other)
        built.append(built_data(job, config).dataset.tensors)
    assert all(torch.equal(a, b) for a, b in zip(*built, strict=True))
    torch.manual_seed(SEED)
    random.seed(3)
    np.random.seed(3)
    loader = prefetcher(job, workers=1)  # built under the worker's torch state
    here = built_data(job, config).dataset
    piece = Piece(0, 5, (3, 40, 7))
    loader.want([piece])
    batch, _ = loader.take(piece)
    expected = load_piece(here, default_collate, piece.indices, piece.seed)
    assert all(torch.equal(a, b) for a, b in zip(batch, expected, strict=True))


def test_a_reply_that_can_never_be_read_is_lost_once_not_asked_of_loaders_for_ever(prefetcher):
    # Before, the piece was asked again of each new loader: the step spun, respawning
    # loaders, until the hang watchdog killed the worker. The reply after it, from the same
    # loader, is still its own piece's.
    loader = prefetcher(jobs.unreadable_job(), workers=1)
    unreadable, readable = Piece(0, 1, (3, 4)), Piece(0, 2, (40, 41))
    loader.want([unreadable, readable])
    outcome = []
    taker = threading.Thread(target=lambda: outcome.append(loader.take(unreadable)), daemon=True)
    taker.start()
    taker.join(60)
    assert not taker.is_alive(), "take() kept asking new loaders"
    assert outcome == [None]  # the worker reads it itself
    batch, _ = loader.take(readable)
    assert [float(x) for x in batch] == [40.0, 41.0]


def test_in_exact_mode_the_worker_reads_a_piece_under_one_thread_as_a_loader_does():
    """A collate that reduces gives other bits at other intra-op thread counts: in exact
    mode the worker reads under one thread, as its loader processes do (a piece of a loader
    that died, a run resumed without loaders); the worker's own count is back afterwards.
    Outside exact mode, nothing changes."""
    seen = []

    def collate(samples):
        seen.append(torch.get_num_threads())
        return default_collate(samples)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        exact = load_piece(list(range(8)), collate, [1, 2], seed=3, one_thread=True)
        plain = load_piece(list(range(8)), collate, [1, 2], seed=3)
        assert seen == [1, 2] and torch.get_num_threads() == 2
        assert torch.equal(exact, plain) and exact.tolist() == [1, 2]
    finally:
        torch.set_num_threads(threads)


def test_an_iterable_dataset_with_a_length_is_refused_as_the_run_starts(tmp_path):
    """webdataset's `with_length` and the like: torch's Dataset still has a __getitem__
    (which raises), so it passed for map-style and failed every step, retried, with
    NotImplementedError."""
    from elastic import BatchConfig, FitConfig, ScalingConfig, TrainJob
    from elastic.errors import ConfigError
    from elastic.trainer.build import built_data

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(64))

        def __len__(self):
            return 64

    job = TrainJob(model=lambda: torch.nn.Linear(1, 1), optimizer=jobs.make_optimizer,
                   loss=jobs.mse, dataset=Stream)
    config = FitConfig(scaling=ScalingConfig(num_workers=1), batch=BatchConfig(global_batch_size=8),
                       max_steps=1, run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"Stream, not a map-style dataset .*IterableDataset"):
        built_data(job, config)
