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


def train_two_ranks(server: RendezvousServer, config: Any, run_dir: str, steps: int,
                    release: bool = False) -> list[Any]:
    """Two ranks of a real replica (`tests.jobs.regression_job`, global batch 16 as 9 + 7 in
    micro-batches of 4 and 3) as threads over real shared memory, each lent the registered
    region its reducer asks for; `release`: each closes its replica after its steps. Asserts
    every step committed and both ranks end on the plain loop's weights (rtol 1e-9); returns
    the replicas."""
    import torch

    from elastic.adapt.plan import BatchPlan
    from elastic.trainer.replica import Replica, StepRecord
    from tests.jobs import reference_weights, regression_job

    batch, plan = 16, BatchPlan(16, (9, 7), (4, 3))
    assert config.batch.global_batch_size == batch
    building = threading.Lock()  # the model is built under the process-wide torch seed
    with building:
        lend = Replica(regression_job(), config, run_dir).registered_bytes()
    assert lend > 0  # the reducer asks the communicator for a region

    def body(comm: Communicator) -> tuple[list[Any], Replica]:
        with building:
            replica = Replica(regression_job(), config, run_dir)
        replica.comm = comm
        replica.sync_from(0)
        outcomes = [replica.run_step(plan, []) for _ in range(steps)]
        if release:  # as a worker that stops: its reducer's region unregistered
            replica.close()
        return outcomes, replica

    results = run_ranks(server, 2, body, shared_bytes=lend)
    reference = reference_weights(0, batch, steps)
    for outcomes, replica in results:
        assert all(isinstance(o, StepRecord) for o in outcomes)
        torch.testing.assert_close(replica.model.state_dict(), reference, rtol=1e-9, atol=1e-10)
    return [replica for _, replica in results]
