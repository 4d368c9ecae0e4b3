"""A Ray Dataset as a sharded source: its blocks are the shards (`elastic.data.sharded`).

The run's controller materialises the dataset once (`Dataset.to_arrow_refs`: Ray Data runs its
pipeline, its transforms in parallel over the cluster) and owns the blocks for as long as the
run lives (a dataset materialised already, `from_items` or `.materialize()`, hands over the
blocks of the process that made it, which Ray loses when that process ends: a detached run's
controller copies them into blocks of its own); workers read the blocks their shares fall in
(`ray.get`, zero-copy on the block's node). From there on the order is the public shard order
of `elastic.data`, so exactly-once, the ledger and replay hold as for any data set. What cannot
keep that promise, and so is not done: Ray Data's own per-epoch randomness (`random_shuffle`,
`randomize_block_order`, a `map_batches` that draws random numbers) runs once, at
materialisation, instead of every epoch; streaming a dataset larger than the object store (it
must fit, with spilling to disk); reading blocks in loader processes (they are not Ray workers:
`data.loader_workers` must be 0, and Ray Data already ran the heavy transforms in parallel).
Augment in `transform`, which runs per row on the worker under the step's seeded generators.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from elastic.data.sharded import ShardedSource
from elastic.job import TrainJob, is_ray_dataset


@ray.remote(num_cpus=0)
def _num_rows(table: Any) -> int:
    return table.num_rows


@ray.remote(num_cpus=0, num_returns=2)
def _own(table: Any) -> tuple[Any, int]:
    """The block again, as an object of the caller, and its rows."""
    return table, table.num_rows


def _owned_by(ref: Any, worker_id: str) -> bool:
    """Whether process `worker_id` owns object `ref` (its owner's address names the worker)."""
    try:
        return worker_id in ref.owner_address().hex()
    except Exception:  # not known: taken for another's (a copy too many, never a block lost)
        return False


class RayDataSource(ShardedSource):
    """The blocks of a Ray Dataset as shards. Build it where the blocks should be owned (the
    controller does, for a `TrainJob` whose `dataset` is a Ray Dataset).

    Args:
        dataset: a `ray.data.Dataset`.
        transform: `row dict -> sample`, run on the worker.
        own: copy the blocks into objects of this process (their owner: blocks another process
            materialised are lost when it ends, as the process that starts a detached run does).
    """

    uses_loader_processes = False

    def __init__(self, dataset: Any, transform: Callable[[dict[str, Any]], Any] | None = None,
                 own: bool = False) -> None:
        # Blocks in the dataset's order: Ray Data yields them as they finish by default, so
        # a resumed run's controller, materialising it again, could lay the rows out in
        # another order (its checkpoint's place in an epoch then names other rows). The
        # dataset's own setting is put back after (a caller's dataset is left as it was).
        options = dataset.context.execution_options
        kept, options.preserve_order = options.preserve_order, True
        try:
            refs = list(dataset.to_arrow_refs())
        finally:
            options.preserve_order = kept
        me = ray.get_runtime_context().get_worker_id()
        # (block, rows) refs: a block of another process copied into one of this one's, if
        # `own`; a block this process made (it ran the dataset's pipeline) as it is.
        pairs = [_own.remote(ref) if own and not _owned_by(ref, me) else (ref, _num_rows.remote(ref))
                 for ref in refs]
        self._refs = [table for table, _ in pairs]
        sizes = ray.get([rows for _, rows in pairs])
        self._cache: OrderedDict[int, Any] = OrderedDict()
        super().__init__(sizes, transform)

    def read(self, shard: int, rows: np.ndarray) -> list[Any]:
        table = self._cache.get(shard)
        if table is None:
            table = self._cache[shard] = ray.get(self._refs[shard])
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return table.take(rows.tolist()).to_pylist()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_cache"] = OrderedDict()
        return state


@dataclasses.dataclass(frozen=True)
class _Source:
    """A data set factory that returns one source built earlier."""

    source: ShardedSource

    def __call__(self) -> ShardedSource:
        return self.source


def data_layout(job: TrainJob) -> str | None:
    """`ShardedSource.layout` of a job `adopt_ray_dataset` returned, if its data set is a
    Ray Dataset's blocks (else None: the workers build the data set)."""
    return job.dataset.source.layout() if isinstance(job.dataset, _Source) else None


def adopt_ray_dataset(job: TrainJob, own: bool = False) -> TrainJob:
    """`job` with a Ray Dataset in `dataset` replaced by a factory of its `RayDataSource`
    (materialised here; `own`: its blocks copied into objects of the caller, which a detached
    run's controller needs, as it outlives the process that started it); any other job as it
    is."""
    if not is_ray_dataset(job.dataset):
        return job
    source = RayDataSource(job.dataset, job.transform, own=own)
    return dataclasses.replace(job, dataset=_Source(source), transform=None)
