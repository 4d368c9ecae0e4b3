"""Data through real kills and resizes (local Ray): loader processes, a sharded parquet source
and a Ray Dataset keep every sample exactly once (the ledger) and end on a plain-PyTorch loop
written here; no loader process outlives its worker; a sample that cannot be read ends the run
as a user error with the loader's traceback."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import elastic
from elastic import BatchConfig, ChaosEvent, DataConfig, FailureConfig, FitConfig, ScalingConfig
from elastic.data import ParquetSource
from elastic.events import WorkerFailure
from tests import fidelity, jobs
from tests.events import of_kind
from tests.integration.test_fit import Operator
from tests.procs import children, wait_gone

pytestmark = pytest.mark.fault

B = 24
SIZES = [30, 10, 25, 6, 25]  # five parquet shards, 96 rows, row groups of 7


def _ledger(result) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(result.run_dir, "ledger.jsonl"))]


def _assert_exactly_once(result, n: int) -> None:
    ledger = _ledger(result)
    assert [entry["step"] for entry in ledger] == list(range(result.steps))
    assert n % B == 0 and result.steps >= n // B  # at least one whole epoch
    for epoch in range(result.steps // (n // B)):  # each completed epoch: every sample once
        seen = [i for entry in ledger if entry["epoch"] == epoch for i in entry["indices"]]
        assert sorted(seen) == list(range(n))


@pytest.mark.timeout(300)
def test_loader_processes_keep_every_sample_once_through_a_kill_and_a_resize(ray_cluster, tmp_path):
    """Dropout and augmentation in loader processes; a worker killed through the API, then a
    resize to 3; the run is stopped. The ledger, the reference, and no loader left behind."""
    name = "loaders-run"
    config = FitConfig(scaling=ScalingConfig(num_workers=2, min_workers=1, max_workers=3),
                       batch=BatchConfig(global_batch_size=B), max_steps=100_000,
                       steps_per_chunk=2, ledger=True, name=name, run_dir=str(tmp_path / "run"),
                       data=DataConfig(loader_workers=1, prefetch_steps=2))
    loaders: set[int] = set()

    def script(op):
        status = op.wait_for(lambda s: s["state"] == "running" and s["step"] >= 2)
        loaders.update(children({w["pid"] for w in status["workers"]}))
        elastic.kill(name, rank=1)
        op.wait_for(lambda s: s["failures"] == 1 and s["step"] >= 5, limit=120)
        elastic.scale(name, 3)
        status = op.wait_for(lambda s: s["world_size"] == 3 and s["step"] >= 9, limit=120)
        loaders.update(children({w["pid"] for w in status["workers"]}))

    with Operator(name, script):
        result = elastic.fit(fidelity.augmented_job(), config)
    assert result.stopped and result.steps >= 9
    assert [f.lost_ranks for f in of_kind(result.events, WorkerFailure)] == [[1]]
    assert 3 in {m["world_size"] for m in result.metrics}
    _assert_exactly_once(result, fidelity.N)
    expected = fidelity.reference(fidelity.augmented_job(), 0, B, B // 2, result.steps)
    for key, value in expected.items():
        torch.testing.assert_close(result.model_state[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert len(loaders) >= 3  # each worker's loader (and its helpers) seen
    assert wait_gone(loaders) == []


# --- a sharded parquet source --------------------------------------------------------------


def _write_shards(folder) -> None:
    x, y = jobs.make_dataset().tensors
    start = 0
    for k, n in enumerate(SIZES):
        table = pa.table({"x": x[start : start + n].tolist(), "y": y[start : start + n, 0].tolist()})
        pq.write_table(table, os.path.join(folder, f"part-{k:02d}.parquet"), row_group_size=7)
        start += n


def to_sample(row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(row["x"], dtype=torch.float64),
            torch.tensor([row["y"]], dtype=torch.float64))


def _sharded_order(sizes: list[int], seed: int, epoch: int) -> torch.Tensor:
    """The README's order, written out: shards by randperm(S, seed + e), rows of shard k by
    randperm(n_k, forward_seed(seed, e, k)); rows numbered shard after shard."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shards = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed + epoch))
    parts = []
    for k in shards.tolist():
        g = torch.Generator().manual_seed(elastic.forward_seed(seed, epoch, k))
        parts.append(torch.randperm(sizes[k], generator=g) + int(starts[k]))
    return torch.cat(parts)


def _plain_loop(x: torch.Tensor, y: torch.Tensor, sizes: list[int], steps: int) -> dict:
    """One process, batch B, the sharded order; written without project code."""
    torch.manual_seed(0)
    model = jobs.make_model()
    opt = jobs.make_optimizer(model.parameters())
    per_epoch = len(x) // B
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        idx = _sharded_order(sizes, 0, epoch)[s * B : (s + 1) * B]
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.timeout(300)
def test_a_sharded_parquet_source_keeps_every_row_once_through_kills(ray_cluster, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    _write_shards(folder)
    path = str(folder)
    job = elastic.TrainJob(model=jobs.make_model, optimizer=jobs.make_optimizer, loss=jobs.mse,
                           dataset=lambda: ParquetSource(path, transform=to_sample))
    chaos = (ChaosEvent(step=2, rank=1, action="kill", phase="forward"),
             ChaosEvent(step=7, rank=0, action="kill", phase="allreduce"))
    config = FitConfig(scaling=ScalingConfig(num_workers=3, min_workers=1),
                       batch=BatchConfig(global_batch_size=B), max_steps=12, steps_per_chunk=2,
                       ledger=True, run_dir=str(tmp_path / "run"), chaos=chaos,
                       data=DataConfig(loader_workers=1))
    result = elastic.fit(job, config)
    assert result.steps == 12
    assert [f.lost_ranks for f in of_kind(result.events, WorkerFailure)] == [[1], [0]]
    _assert_exactly_once(result, sum(SIZES))
    for entry in _ledger(result):  # the public sharded order, step by step
        epoch, s = divmod(entry["step"], sum(SIZES) // B)
        assert entry["indices"] == _sharded_order(SIZES, 0, epoch)[s * B : (s + 1) * B].tolist()
    table = pq.read_table([str(p) for p in sorted(folder.iterdir())])
    x = torch.tensor(table.column("x").to_pylist(), dtype=torch.float64)
    y = torch.tensor(table.column("y").to_pylist(), dtype=torch.float64)[:, None]
    expected = _plain_loop(x, y, SIZES, 12)
    for key, value in expected.items():
        torch.testing.assert_close(result.model_state[key], value, rtol=1e-9, atol=1e-10, msg=key)


@pytest.mark.timeout(300)
def test_a_ray_dataset_is_read_exactly_once_through_a_kill(ray_cluster, tmp_path):
    import ray

    x, y = jobs.make_dataset().tensors
    rows = [{"x": x[i].tolist(), "y": float(y[i, 0])} for i in range(len(x))]
    dataset = ray.data.from_items(rows, override_num_blocks=4)
    sizes = [t.num_rows for t in ray.get(dataset.to_arrow_refs())]
    assert len(sizes) == 4 and sum(sizes) == len(x)
    job = elastic.TrainJob(model=jobs.make_model, optimizer=jobs.make_optimizer, loss=jobs.mse,
                           dataset=dataset, transform=to_sample)
    config = FitConfig(scaling=ScalingConfig(num_workers=2, min_workers=1),
                       batch=BatchConfig(global_batch_size=B), max_steps=8, steps_per_chunk=2,
                       ledger=True, run_dir=str(tmp_path / "run"),
                       chaos=(ChaosEvent(step=3, rank=1, action="kill", phase="backward"),))
    result = elastic.fit(job, config)
    assert result.steps == 8
    assert len(of_kind(result.events, WorkerFailure)) == 1
    _assert_exactly_once(result, len(x))
    expected = _plain_loop(x, y, sizes, 8)  # from_items keeps the rows' order across blocks
    for key, value in expected.items():
        torch.testing.assert_close(result.model_state[key], value, rtol=1e-9, atol=1e-10, msg=key)


@pytest.mark.timeout(180)
def test_a_ray_datasets_rows_keep_its_order_when_a_block_finishes_last(ray_cluster):
    """The first block's transform finishes only after the last block's began (a gate it
    opens): Ray Data hands blocks over as they finish unless asked to keep their order, so a
    resumed run's controller, materialising the dataset again, laid the rows out in another
    order than the run that wrote the checkpoint, whose place in an epoch then named other
    rows. The source keeps the dataset's order."""
    import ray

    from elastic.actors.raydata import RayDataSource

    @ray.remote(num_cpus=0)
    class Gate:
        def __init__(self):
            import threading
            self.opened = threading.Event()

        def open(self):
            self.opened.set()

        def wait(self):
            return self.opened.wait(60)

    gate = Gate.options(max_concurrency=4).remote()

    def slow_first(batch):
        first = int(batch["id"][0])
        if first == 0:
            assert ray.get(gate.wait.remote())
        elif first == 300:
            ray.get(gate.open.remote())
        return batch

    dataset = ray.data.range(400, override_num_blocks=4).map_batches(
        slow_first, batch_size=None, num_cpus=0)
    source = RayDataSource(dataset)
    assert not dataset.context.execution_options.preserve_order  # the caller's, as it was
    assert source.sizes == [100] * 4
    assert [row["id"] for row in source.__getitems__(range(400))] == list(range(400))


@pytest.mark.timeout(180)
def test_a_detached_runs_copy_of_a_materialised_ray_dataset_outlives_the_process_that_made_it(
        ray_cluster):
    # `from_items` or `.materialize()` hands over blocks of the process that made them, and Ray
    # loses those when it ends (the process that starts a detached run exits at once): before,
    # the detached controller's workers then failed reading them.
    import ray

    from elastic.actors.raydata import RayDataSource

    @ray.remote(num_cpus=0)
    class Starter:  # the process that starts the run, then exits
        def dataset(self):
            # Blocks of about 400 KB: in the object store, not inlined by value (< 100 KB).
            rows = [{"x": [float(i)] * 5000, "y": float(i)} for i in range(40)]
            return ray.data.from_items(rows, override_num_blocks=4).materialize()

        def me(self):
            return ray.get_runtime_context().get_worker_id()

    @ray.remote(num_cpus=0)
    class Holder:  # the detached run's controller
        def adopt(self, dataset, own):
            self.source = RayDataSource(dataset, own=own)
            # Ray's owner of each block (its address holds the owner's worker id).
            return ray.get_runtime_context().get_worker_id(), [
                ref.owner_address().hex() for ref in self.source._refs]

        def ys(self):
            return sorted(row["y"] for row in self.source.__getitems__(range(len(self.source))))

    starter = Starter.remote()
    dataset, made_by = ray.get([starter.dataset.remote(), starter.me.remote()])
    owned = Holder.remote()
    holder, owners = ray.get(owned.adopt.remote(dataset, True))
    assert len(owners) == 4 and all(holder in owner for owner in owners)
    _, borrowed = ray.get(Holder.remote().adopt.remote(dataset, False))
    assert all(made_by in owner for owner in borrowed)  # the old way: the starter's blocks
    del dataset
    ray.kill(starter)
    with pytest.raises(ray.exceptions.RayActorError):  # once it is gone
        ray.get(starter.me.remote(), timeout=60)
    assert ray.get(owned.ys.remote(), timeout=60) == [float(i) for i in range(40)]


def test_a_ray_dataset_refuses_loader_processes(ray_cluster, tmp_path):
    import ray

    job = elastic.TrainJob(model=jobs.make_model, optimizer=jobs.make_optimizer, loss=jobs.mse,
                           dataset=ray.data.from_items([{"x": [0.0] * 6, "y": 0.0}] * 8),
                           transform=to_sample)
    config = FitConfig(scaling=ScalingConfig(num_workers=1), batch=BatchConfig(global_batch_size=4),
                       max_steps=1, run_dir=str(tmp_path / "run"), data=DataConfig(loader_workers=1))
    with pytest.raises(elastic.ElasticError, match=r"data\.loader_workers"):
        elastic.fit(job, config)


@pytest.mark.timeout(240)
def test_a_sample_that_cannot_be_read_in_a_loader_fails_the_run_with_its_traceback(ray_cluster, tmp_path):
    config = FitConfig(scaling=ScalingConfig(num_workers=2), max_steps=8,
                       batch=BatchConfig(global_batch_size=8, rebalance=False, autotune=False),
                       failure=FailureConfig(max_user_retries=1), run_dir=str(tmp_path / "run"),
                       data=DataConfig(loader_workers=1))
    with pytest.raises(elastic.UserCodeError) as info:
        elastic.fit(jobs.corrupt_job(), config)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    position = int((perm == 7).nonzero())
    error = info.value
    assert (error.step, error.rank) == (position // 8, (position % 8) // 4)
    assert "in a loader process" in error.traceback
    assert "ValueError: sample 7 is corrupt" in error.traceback
