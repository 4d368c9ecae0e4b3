"""Registered buffers: shared memory a communicator lends, which the direct allreduce reduces
where it lies (`Communicator.shared_buffers`), and the trainer's flat gradient buffers in it.

The property test in test_collective.py draws registered buffers for every algorithm; abort,
timeout and killed peers on them are in tests/fault/test_collective_faults.py."""

from __future__ import annotations

import mmap
import os
import threading

import pytest
import torch

from elastic import BatchConfig, FitConfig, ScalingConfig
from elastic.collective import RendezvousServer, direct, shm, shm_segments
from elastic.config import CollectiveConfig
from elastic.errors import CollectiveError
from elastic.trainer.replica import Replica
from tests.jobs import regression_job
from tests.threads import run_ranks, train_two_ranks

pytestmark = [pytest.mark.skipif(shm.supported() is not None, reason=str(shm.supported())),
              pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server():
    srv = RendezvousServer()
    yield srv
    srv.close()


@pytest.mark.parametrize(("world_size", "hosts", "chunk"), [
    (2, None, 4 << 20), (3, None, 4096), (4, None, 8192), (5, None, 4096),
    (4, 2, 4096), (5, 2, 8192), (6, 3, 4096),
], ids=["2", "3-chunks", "4-chunks", "5-chunks", "2x2-hosts", "3+2-hosts", "3x2-hosts"])
def test_every_rank_ends_with_the_exact_sum_in_its_region_and_nothing_else_moves(
        server, registered_calls, world_size, hosts, chunk):
    # Integers sum exactly: every rank's buffer holds the same sum, reduced where it lies. A
    # second buffer in the same region (another dtype, allreduced later with 'max') is not
    # touched by the first allreduce, on any rank.
    n = 50_003

    def body(comm):
        lent = comm.shared_buffers({torch.int64: n, torch.float64: 11})
        assert lent is not None
        ints, floats = lent[torch.int64], lent[torch.float64]
        ints.copy_(torch.arange(n) * (comm.rank + 1) - 7)
        floats.fill_(float(comm.rank))
        comm.allreduce(ints, "sum", "auto")
        untouched = bool(torch.all(floats == float(comm.rank)))
        comm.allreduce(floats, "max", "direct")
        return ints.clone(), untouched, floats.clone()

    config = CollectiveConfig(shm_chunk_bytes=chunk, simulated_hosts=hosts)
    results = run_ranks(server, world_size, body, config, shared_bytes=n * 8 + 11 * 8 + 64)
    expected = torch.arange(n) * (world_size * (world_size + 1) // 2) - 7 * world_size
    for ints, untouched, floats in results:
        assert torch.equal(ints, expected)
        assert untouched
        assert torch.equal(floats, torch.full((11,), float(world_size - 1), dtype=torch.float64))
    assert sorted(registered_calls) == sorted(list(range(world_size)) * 2)


def test_ranks_that_reduce_different_buffers_fail_instead_of_mixing_memory(server, registered_calls):
    # Rank 0 passes its registered buffer, rank 1 a tensor of its own: the direct allreduce
    # would read and write them in different patterns, so both ranks fail at the first stage,
    # naming the disagreement, and neither buffer is written.
    def body(comm):
        lent = comm.shared_buffers({torch.float32: 1000})
        assert lent is not None
        tensor = lent[torch.float32] if comm.rank == 0 else torch.empty(1000)
        tensor.fill_(3.0)
        with pytest.raises(CollectiveError) as info:
            comm.allreduce(tensor, "sum", "direct")
        return str(info.value), bool(torch.all(tensor == 3.0))

    for message, untouched in run_ranks(server, 2, body, shared_bytes=4096):
        assert "allreduces another buffer" in message
        assert untouched
    assert registered_calls == [0]


def test_a_buffer_at_another_offset_fails_too(server):
    def body(comm):
        lent = comm.shared_buffers({torch.float32: 2000})
        assert lent is not None
        tensor = lent[torch.float32][: 1000] if comm.rank == 0 else lent[torch.float32][1000:]
        with pytest.raises(CollectiveError, match="allreduces another buffer"):
            comm.allreduce(tensor.fill_(1.0), "sum", "direct")

    run_ranks(server, 2, body, shared_bytes=8192)


@pytest.mark.parametrize(("world_size", "config", "lend", "sizes"), [
    (2, CollectiveConfig(), 0, {torch.float32: 10}),  # nothing lent
    (2, CollectiveConfig(), 4096, {torch.float32: 1025}),  # does not fit
    (2, CollectiveConfig(), 4096, {torch.float32: 512, torch.float64: 257}),  # the second does not
    (2, CollectiveConfig(shared_memory=False), 4096, {torch.float32: 10}),  # gloo only
    (2, CollectiveConfig(shm_registered_buffers=False), 4096, {torch.float32: 10}),  # turned off
    (1, CollectiveConfig(), 4096, {torch.float32: 10}),  # alone
    (3, CollectiveConfig(simulated_hosts=2), 4096, {torch.float32: 10}),  # rank 2 alone on its host
], ids=["none-lent", "too-big", "second-too-big", "gloo", "off", "alone", "one-alone-on-a-host"])
def test_no_buffer_is_lent_where_none_can_be_reduced_in_place(server, world_size, config, lend,
                                                              sizes):
    results = run_ranks(server, world_size, lambda c: c.shared_buffers(sizes), config,
                        shared_bytes=lend)
    assert results == [None] * world_size


@pytest.mark.parametrize(("world_size", "hosts"), [(4, 2), (5, 2)], ids=["2x2", "3+2"])
def test_pieces_cross_between_hosts_while_the_next_is_reduced(server, registered_calls,
                                                              monkeypatch, world_size, hosts):
    # Small pieces (8 KiB) so that a 400 KB buffer crosses in many: the swaps of a piece are
    # in flight while the next is reduced (both scratch halves, both tags in use). Two
    # registered allreduces in a row, then one of a tensor of the caller's, all exact.
    monkeypatch.setattr(direct, "_CROSSING_BYTES", 8192)
    n = 50_003

    def body(comm):
        lent = comm.shared_buffers({torch.int64: n})
        assert lent is not None
        ints, results = lent[torch.int64], []
        for factor in (1, 3):
            ints.copy_(torch.arange(n) * (comm.rank + factor))
            results.append(comm.allreduce(ints, "sum", "auto").clone())
        results.append(comm.allreduce(torch.arange(n) * comm.rank, "sum", "auto"))
        return results

    config = CollectiveConfig(shm_chunk_bytes=4096, simulated_hosts=hosts)
    total = world_size * (world_size - 1) // 2
    for first, second, plain in run_ranks(server, world_size, body, config, shared_bytes=n * 8):
        assert torch.equal(first, torch.arange(n) * (total + world_size))
        assert torch.equal(second, torch.arange(n) * (total + 3 * world_size))
        assert torch.equal(plain, torch.arange(n) * total)
    assert sorted(registered_calls) == sorted(list(range(world_size)) * 2)


def test_a_host_with_a_single_rank_means_no_rank_lends(server, registered_calls):
    # Ranks 0-1 share a host, rank 2 is alone on its own: no rank lends, so both hosts cross
    # in the same pattern (the chunked one), and an allreduce longer than a chunk is exact.
    def body(comm):
        lent = comm.shared_buffers({torch.float32: 100})
        data = torch.arange(5000, dtype=torch.float32) * (comm.rank + 1)
        return comm._transport.region, lent, comm.allreduce(data, "sum", "auto")

    config = CollectiveConfig(shm_chunk_bytes=4096, simulated_hosts=2)
    for region, lent, total in run_ranks(server, 3, body, config, shared_bytes=1 << 20):
        assert (region, lent) == (0, None)
        assert torch.equal(total, torch.arange(5000, dtype=torch.float32) * 6)
    assert registered_calls == []


def test_buffers_are_laid_out_alike_on_every_rank_and_lent_again(server):
    def body(comm):
        first = comm.shared_buffers({torch.float32: 3, torch.float64: 5, torch.int64: 2})
        again = comm.shared_buffers({torch.float32: 3, torch.float64: 5, torch.int64: 2})
        host = comm._transport
        return ([host.registered(t) for t in first.values()],
                [a.data_ptr() == b.data_ptr() for a, b in zip(first.values(), again.values(), strict=True)],
                [t.numel() for t in first.values()])

    for offsets, same, sizes in run_ranks(server, 3, body, shared_bytes=4096):
        assert offsets == [0, 64, 128]  # each at a multiple of 64 bytes
        assert same == [True, True, True]
        assert sizes == [3, 5, 2]


@pytest.mark.parametrize(("world_size", "hosts"), [(2, None), (4, 2)], ids=["one-host", "2x2"])
def test_a_rank_without_room_for_its_region_keeps_shared_memory_without_one(server, monkeypatch,
                                                                            world_size, hosts):
    # /dev/shm refuses one rank's segment with its region (the first to ask): that rank
    # offers one without, so its host keeps shared memory, no rank of the generation lends a
    # region (on 2 hosts, the other host neither: both cross in the same pattern), the others
    # give theirs back, and the direct allreduce copies through its buffers, over several
    # chunks.
    create = shm_segments._create_segment
    lock, refused = threading.Lock(), []

    def refusing(path, size):
        with lock:
            if size > 1 << 20 and not refused:
                refused.append(path)
                return None, f"cannot create a {size}-byte segment in /dev/shm: no room (injected)"
        return create(path, size)

    monkeypatch.setattr(shm_segments, "_create_segment", refusing)

    def body(comm):
        lent = comm.shared_buffers({torch.float32: 100})
        data = torch.arange(5000, dtype=torch.float32) * (comm.rank + 1)
        return comm.transport, lent is None, comm.allreduce(data, "sum", "direct")

    config = CollectiveConfig(shm_chunk_bytes=4096, simulated_hosts=hosts)
    results = run_ranks(server, world_size, body, config, shared_bytes=4 << 20)
    assert len(refused) == 1
    expected = torch.arange(5000, dtype=torch.float32) * (world_size * (world_size + 1) // 2)
    for transport, none_lent, total in results:
        assert transport == ("shared_memory" if hosts is None else "shared_memory+gloo")
        assert none_lent
        assert torch.equal(total, expected)


def test_a_region_that_is_not_lent_goes_back_to_dev_shm(tmp_path):
    path = os.path.join("/dev/shm", f"elastic-shm-{os.getpid()}-{'ef' * 16}")
    mm, problem = shm_segments._create_segment(path, 4 << 20)
    try:
        assert problem is None
        mm[:] = b"\1" * (4 << 20)
        before = os.stat(path).st_blocks
        shm_segments._give_back(mm, 1000, 4 << 20)  # from the first page boundary after 1000
        after = os.stat(path).st_blocks
        assert after * 512 <= before * 512 - (4 << 20) + mmap.PAGESIZE
        assert mm[:1000] == b"\1" * 1000
    finally:
        mm.close()
        os.unlink(path)


def test_training_steps_reduce_the_flat_gradients_where_they_lie(tmp_path, server, registered_calls):
    # Two ranks of a real replica: every step's flat gradient buffers are lent by the
    # communicator and reduced in place, and the weights equal the plain-PyTorch reference.
    steps, batch = 3, 16
    config = FitConfig(
        scaling=ScalingConfig(num_workers=2, min_workers=1),
        batch=BatchConfig(global_batch_size=batch, autotune=False, rebalance=False),
        run_dir=str(tmp_path), max_steps=steps, ledger=True)
    train_two_ranks(server, config, str(tmp_path), steps)
    assert sorted(registered_calls) == [0] * steps + [1] * steps


def test_a_replica_asks_for_no_region_when_it_reduces_no_flat_host_buffers(tmp_path):
    def lend(**collective) -> int:
        config = FitConfig(
            scaling=ScalingConfig(num_workers=2, min_workers=1),
            collective=CollectiveConfig(**collective),
            batch=BatchConfig(global_batch_size=16, autotune=False, rebalance=False),
            run_dir=str(tmp_path), max_steps=1)
        return Replica(regression_job(), config, str(tmp_path)).registered_bytes()

    flat = lend()
    # float64 parameters of tests.jobs.make_model, 64-byte aligned, and the metadata's room
    assert flat == -(-(6 * 8 + 8 + 8 + 1) * 8 // 64) * 64 + (1 << 16) * 8 + 64
    assert lend(overlap=True) == 0  # buckets reduce their own buffers
