"""The pipes between a worker and its loader processes (no Ray): a batch read for a piece that
was dropped is still received, so its shared memory does not pile up in the loader; a loader
that dies while reading is reported, not waited on; a batch that cannot be sent is the user's
error; closing with reads under way leaves no process; a worker is built only once its loaders
have built the data set."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading

import pytest
import torch

from elastic import TrainJob
from elastic.config import BatchConfig, DataConfig, FitConfig, ScalingConfig
from elastic.trainer.loader import LoadError, Piece
from elastic.trainer.replica import Replica
from tests import fidelity, jobs
from tests.procs import wait_gone

pytestmark = pytest.mark.timeout(120)

CRASH = 13  # the sample whose read kills its process


class CrashingSample(torch.utils.data.Dataset):
    """32 samples; reading sample 13 kills the process reading it (a crash in native code)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        if i == CRASH:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((jobs.N_FEATURES,), float(i)), torch.zeros(1)


def crashing_job() -> TrainJob:
    return TrainJob(model=jobs.make_model, optimizer=jobs.make_optimizer, loss=jobs.mse,
                    dataset=CrashingSample)


def unsendable_job() -> TrainJob:
    """A collate function whose batch cannot be pickled."""
    return TrainJob(model=jobs.make_model, optimizer=jobs.make_optimizer, loss=jobs.mse,
                    dataset=fidelity.Augmented, collate_fn=lambda samples: (lambda: samples))


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_a_dropped_batch_is_received_and_its_shared_memory_released(prefetcher):
    """One loader reads in order: by the time the kept piece is taken, the dropped one before
    it has been received (and freed). Were it left in the pipe, the loader would hold a file
    per tensor of each dropped batch."""
    loader = prefetcher(fidelity.augmented_job(), workers=1)
    assert loader.take(Piece(0, 0, (0,))) is None  # not asked for
    loader.want([Piece(0, 0, (0,))])
    assert loader.take(Piece(0, 0, (0,))) is not None
    [pid] = loader.pids()
    before = _open_files(pid)
    for step in range(1, 21):
        dropped, kept = Piece(step, 1, (1, 2)), Piece(step, 2, (3, 4))
        loader.want([dropped, kept])
        loader.want([kept])  # a replan: `dropped` is being read, and is never handed out
        assert loader.take(dropped) is None
        assert loader.take(kept) is not None
    # 40 more (2 tensors x 20) if they were left there; a few may be open for a moment: the
    # last batches' storages the loader has sent and not yet freed (a bound of 2 failed once)
    assert _open_files(pid) <= before + 8
    assert loader.served == 21 and loader.pids() == [pid]


def test_a_loader_that_dies_reading_the_piece_taken_is_an_error_not_a_hang(prefetcher):
    loader = prefetcher(crashing_job(), workers=1)
    loader.want([Piece(0, 1, (1,))])
    assert loader.take(Piece(0, 1, (1,))) is not None
    [pid] = loader.pids()
    crash = Piece(1, 2, (2, CRASH))
    loader.want([crash])
    with pytest.raises(LoadError, match="died"):
        loader.take(crash)
    assert wait_gone([pid]) == [] and loader.pids() and pid not in loader.pids()
    # Asked again (a redo of the step), it is not given to a loader: the worker reads it
    # itself, so a piece that crashes its loader does not crash one after another.
    loader.want([crash, Piece(1, 3, (4,))])
    assert loader.take(crash) is None
    assert loader.take(Piece(1, 3, (4,))) is not None  # the new loader reads


def test_a_batch_that_cannot_be_sent_is_the_users_error(prefetcher):
    loader = prefetcher(unsendable_job(), workers=1)
    loader.want([Piece(5, 1, (1, 2)), Piece(5, 2, (3,))])
    for seed in (1, 2):
        with pytest.raises(LoadError, match="sending the batch to the worker failed"):
            loader.take(Piece(5, seed, (1, 2) if seed == 1 else (3,)))


def test_closing_with_reads_under_way_leaves_no_loader_process(prefetcher):
    loader = prefetcher(fidelity.augmented_job(), workers=2)
    loader.want([Piece(s, s, tuple(range(s, s + 8))) for s in range(8)])
    pids = loader.pids()
    assert len(pids) == 2
    loader.close()
    assert wait_gone(pids, timeout=10) == []
    assert loader.take(Piece(0, 0, tuple(range(8)))) is None
    loader.want([Piece(9, 9, (1,))])  # closed: nothing is started again
    assert loader.pids() == []


def _marked_dataset(directory: str, fail: str | None = None):
    """The regression data set; in a loader process, first `fail` ('raise', 'die' or 'hang'), and once
    built a file named after the process in `directory`."""
    in_loader = multiprocessing.parent_process() is not None
    if in_loader and fail == "raise":
        raise RuntimeError("no data here")
    if in_loader and fail == "die":
        os._exit(3)
    if in_loader and fail == "hang":
        threading.Event().wait()
    data = jobs.make_dataset()
    if in_loader:
        with open(os.path.join(directory, str(os.getpid())), "w"):
            pass
    return data


def _marked_job(directory, fail: str | None = None) -> TrainJob:
    return TrainJob(model=jobs.make_model, optimizer=jobs.make_optimizer, loss=jobs.mse,
                    dataset=functools.partial(_marked_dataset, str(directory), fail))


def test_wait_started_returns_once_every_loader_has_built_the_data_set(prefetcher, tmp_path):
    # Spawned: a spawned loader imports torch before it builds anything, so without the wait
    # there would be no file yet.
    loader = prefetcher(_marked_job(tmp_path), workers=3, start_method="spawn")
    loader.wait_started()
    assert sorted(int(f) for f in os.listdir(tmp_path)) == sorted(loader.pids())
    loader.wait_started()  # again: returns at once
    piece = Piece(0, 1, (2, 5))
    loader.want([piece])
    assert loader.take(piece) is not None  # the start notices are not taken for batches


@pytest.mark.parametrize("fail", ["raise", "die"])
def test_a_loader_that_cannot_build_the_data_set_fails_the_first_piece_not_the_wait(
        prefetcher, tmp_path, fail):
    loader = prefetcher(_marked_job(tmp_path, fail), workers=1)
    loader.wait_started()
    piece = Piece(0, 1, (2, 5))
    loader.want([piece])
    with pytest.raises(LoadError, match="building the data set" if fail == "raise" else "died"):
        loader.take(piece)


def test_wait_started_gives_up_on_a_loader_stuck_building_the_data_set(prefetcher, tmp_path):
    loader = prefetcher(_marked_job(tmp_path, "hang"), workers=1)
    assert loader.wait_started(timeout=0.5) is False


def test_a_replica_is_built_only_once_its_loaders_have_built_the_data_set(tmp_path):
    config = FitConfig(scaling=ScalingConfig(num_workers=1),
                       batch=BatchConfig(global_batch_size=8, autotune=False), max_steps=2,
                       run_dir=str(tmp_path / "run"), data=DataConfig(loader_workers=2))
    marks = tmp_path / "marks"
    marks.mkdir()
    replica = Replica(_marked_job(marks), config, str(tmp_path / "run"))
    try:
        assert sorted(int(f) for f in os.listdir(marks)) == sorted(replica.prefetcher.pids())
    finally:
        replica.close()


class _LatePipe:
    """A loader's pipe whose messages arrive only after the first look finds nothing."""

    def __init__(self, messages: list[bytes]) -> None:
        self._messages = messages
        self._looked = False

    def poll(self) -> bool:
        arrived, self._looked = self._looked, True
        return arrived and bool(self._messages)

    def recv_bytes(self) -> bytes:
        return self._messages.pop(0)


def test_a_start_notice_arriving_after_a_piece_was_asked_is_not_taken_for_its_batch():
    # A replacement loader is asked for pieces at once, before it has built the data set.
    from collections import deque
    from multiprocessing.reduction import ForkingPickler

    from elastic.trainer import loader as loader_module

    piece = Piece(0, 1, (2, 5))
    reply = (True, torch.arange(3), None)
    pipe = _LatePipe([bytes(ForkingPickler.dumps(loader_module._STARTED)),
                      bytes(ForkingPickler.dumps(reply))])
    prefetcher = loader_module.Prefetcher.__new__(loader_module.Prefetcher)
    prefetcher._wanted, prefetcher._ready, prefetcher._pinner = {piece: None}, {}, None
    one = loader_module._Loader(process=None, conn=pipe, asked=deque([piece]))
    assert prefetcher._receive(one)  # nothing there yet
    assert prefetcher._receive(one)  # the notice, then the batch
    assert one.started and not one.asked
    assert torch.equal(prefetcher._ready[piece][1], torch.arange(3))
