"""Runs the ranks of a communicator as threads of the test process (fast, no Ray)."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any

from elastic.collective import Communicator, RendezvousServer
from elastic.config import CollectiveConfig

_generations = itertools.count()


def run_ranks(
    server: RendezvousServer,
    world_size: int,
    fn: Callable[[Communicator], Any],
    config: CollectiveConfig | None = None,
    timeout: float = 60.0,
    shared_bytes: int = 0,
) -> list[Any]:
    """Calls `fn(comm)` on every rank of a fresh generation; returns results in rank order
    and re-raises the first rank's exception."""
    generation = next(_generations)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    # A communicator is closed once every rank is done with it, as the controller closes a
    # generation only once every rank's chunk has returned: closing aborts NCCL, which would
    # cut short a peer still finishing its last operation.
    done = threading.Barrier(world_size)

    def target(rank: int) -> None:
        try:
            try:
                comm = Communicator(rank, world_size, server.endpoint, generation, config,
                                    secret=server.secret, shared_bytes=shared_bytes)
            except BaseException:
                done.abort()
                raise
            try:
                results[rank] = fn(comm)
            except BaseException:
                done.abort()  # a failed rank closes at once: its peers are not kept waiting
                raise
            finally:
                with contextlib.suppress(threading.BrokenBarrierError):
                    done.wait(timeout)
                comm.close()
        except BaseException as e:
            errors[rank] = e

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raised = next((e for e in errors if e is not None), None)
            raise TimeoutError(f"a rank did not finish within {timeout}s"
                               + (f"; another raised {raised!r}" if raised else "")) from raised
    for e in errors:
        if e is not None:
            raise e
    return results
