"""Ranks as real processes, for abort and peer-death tests of the collective layer.

Each child builds a communicator, runs a scenario, and reports to the parent through a pipe.
The parent plays the controller: it kills ranks and tells survivors to abort or to form a new
generation.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import threading
from datetime import timedelta
from multiprocessing.connection import Connection

import torch

from elastic.collective import Communicator, Endpoint, RendezvousServer
from elastic.config import CollectiveConfig
from elastic.errors import CollectiveError


def _listen(conn: Connection, comm_box: dict, orders: queue.SimpleQueue) -> None:
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message == "abort":
            comm_box["signal"].set()
            comm = comm_box.get("comm")
            if comm is not None:
                comm.abort()
        else:
            orders.put(message)


def rank_main(rank: int, world_size: int, endpoint: str, secret: bytes, scenario: str,
              conn: Connection, timeout_s: float = 300.0, shared_memory: bool = True,
              algorithm: str = "ring", hosts: int | None = None) -> None:
    """Child entry point. Reports ("error", type name) when an operation fails. An algorithm
    named "<algorithm>+registered" allreduces registered buffers (`Communicator.shared_buffers`).

    Ends with `os._exit`: a process that abandoned gloo operations must not run interpreter
    finalization while gloo may still wake their waiter threads (see `elastic.collective.gloo`).
    """
    try:
        config = CollectiveConfig(timeout=timedelta(seconds=timeout_s), segment_bytes=1 << 18,
                                  shared_memory=shared_memory, shm_chunk_bytes=1 << 18,
                                  simulated_hosts=hosts)
        _scenario(rank, world_size, endpoint, secret, scenario, conn, config, algorithm)
    finally:
        conn.close()
        os._exit(0)


def _scenario(rank: int, world_size: int, endpoint: str, secret: bytes, scenario: str,
              conn: Connection, config: CollectiveConfig, algorithm: str) -> None:
    algorithm, _, registered = algorithm.partition("+")
    lend = 8 << 20 if registered else 0
    comm_box: dict = {"signal": threading.Event()}
    orders: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_listen, args=(conn, comm_box, orders), daemon=True).start()
    ep = Endpoint.parse(endpoint)

    def report_failure(e: BaseException) -> None:
        conn.send(("error", type(e).__name__, isinstance(e, CollectiveError)))

    try:
        comm = Communicator(rank, world_size, ep, 0, config, abort_signal=comm_box["signal"],
                            secret=secret, shared_bytes=lend)
        comm_box["comm"] = comm

        def tensor(numel: int) -> torch.Tensor:
            lent = comm.shared_buffers({torch.float32: numel}) if lend else None
            assert (lent is not None) == bool(lend), "no registered buffer was lent"
            return torch.empty(numel) if lent is None else lent[torch.float32]
    except Exception as e:
        report_failure(e)
        return
    conn.send(("connected", rank, comm.transport))
    try:
        if scenario == "recv_forever":
            if rank == 1:
                comm.recv(torch.zeros(4), src=0)
            else:
                orders.get()  # never sends; waits to be told to exit
                return
        elif scenario == "allreduce_alone":
            if rank == 0:
                orders.get()  # never joins; waits to be told to exit
                return
            data = tensor(1 << 16).fill_(7.0)
            try:
                comm.allreduce(data, "sum", algorithm)  # type: ignore[arg-type]
            finally:
                # Whether the failed allreduce left the caller's tensor as it was.
                conn.send(("untouched", bool(torch.all(data == 7.0))))
        elif scenario == "allreduce_forever":
            data, work = torch.full((1 << 20,), float(rank + 1)), tensor(1 << 20)
            first = True
            while True:
                comm.allreduce(work.copy_(data), "sum", algorithm)  # type: ignore[arg-type]
                if first:
                    conn.send(("running", rank))
                    first = False
        conn.send(("finished", rank))
        return
    except Exception as e:
        report_failure(e)
    # Survivors may be told to form a new generation: ("regen", new_rank, new_world, gen).
    message = orders.get()
    if message[0] == "regen":
        _, new_rank, new_world, generation = message
        comm = Communicator(new_rank, new_world, ep, generation, config, secret=secret,
                            shared_bytes=lend)
        comm_box["comm"] = comm
        data = tensor(1001).fill_(float(new_rank + 1))  # a region the new generation lends
        result = comm.allreduce(data, "sum", algorithm)  # type: ignore[arg-type]
        conn.send(("regen_result", new_rank, result.tolist()))
        comm.close()


# What the children of `warm_context` find imported.
_PRELOAD = ["torch", "elastic.collective", "elastic.checkpoint", "elastic.trainer.loader",
            "tests.procs", "tests.fidelity"]


def _fresh_numpy_entropy() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a spawned child draws its own, not its forkserver's


# In the forkserver (which imports this module) and wherever else this module forks from.
os.register_at_fork(after_in_child=_fresh_numpy_entropy)


def warm_context() -> mp.context.BaseContext:
    """Where the tests start processes of their own (ranks, writers to kill): a forkserver
    whose server has imported torch and the collective layer, so that a child starts without
    the 2 s of imports a spawned one pays on two cores. A child is still a fresh process with
    no thread of this one's: it is forked from the server, a new interpreter that has only
    imported `_PRELOAD`. The server keeps the environment it started with (the first call's):
    a test that changes the environment for a child must spawn it."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class Ranks:
    """Starts `world_size` ranks (or a subset) running one scenario."""

    def __init__(self, world_size: int, server: RendezvousServer, scenario: str,
                 start: list[int] | None = None, timeout_s: float = 300.0,
                 shared_memory: bool = True, algorithm: str = "ring",
                 hosts: int | None = None) -> None:
        ctx = warm_context()
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self.pipes: dict[int, Connection] = {}
        for rank in start if start is not None else range(world_size):
            parent, child = ctx.Pipe()
            # The secret goes through the start pipe, as it goes through Ray calls in a run.
            proc = ctx.Process(target=rank_main, args=(rank, world_size, str(server.endpoint),
                                                       server.secret, scenario, child, timeout_s,
                                                       shared_memory, algorithm, hosts),
                               daemon=True)
            proc.start()
            self.procs[rank] = proc
            self.pipes[rank] = parent

    def expect(self, rank: int, kind: str, timeout: float = 120.0) -> tuple:
        """Next message of `rank`, which must be of `kind`."""
        pipe = self.pipes[rank]
        if not pipe.poll(timeout):
            raise TimeoutError(f"rank {rank} sent nothing within {timeout}s")
        message = pipe.recv()
        assert message[0] == kind, f"rank {rank}: expected {kind}, got {message}"
        return message

    def send(self, rank: int, message: object) -> None:
        self.pipes[rank].send(message)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(10)


# --- processes a test watches from outside (loader processes of a worker) -------------------


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(parents: set[int]) -> set[int]:
    """Processes whose parent is one of `parents`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) in parents:
                        found.add(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


def wait_gone(pids, timeout: float = 30.0) -> list[int]:
    """Polls until every process of `pids` has exited (or `timeout`); returns those still
    running."""
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
        while any(alive(p) for p in pids) and not deadline.wait(0.05):
            pass
    finally:
        timer.cancel()
    return [p for p in pids if alive(p)]
