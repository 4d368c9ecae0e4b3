"""Sharded optimizer state (stages 1 and 2) through real kills on local Ray: a lost owner's
parts come from their other owner (no checkpoint), a kill while the parameters are gathered,
every owner of a part lost (the checkpoint), and checkpoints that hold the whole optimizer
state and load at stage 0 and stage 1 on other world sizes; against the plain-PyTorch loop of
`tests/sharding.py`, every sample once."""

import json
import os
import shutil

import pytest
import torch

import elastic
from elastic import (
    BatchConfig,
    ChaosEvent,
    CheckpointConfig,
    FitConfig,
    ScalingConfig,
    ShardingConfig,
    TrainingConfig,
)
from elastic.events import (
    Generation,
    PlannedDeparture,
    RestoredFromCheckpoint,
    Resumed,
    ShardsLost,
    WorkerFailure,
    WorkerJoined,
)
from tests import sharding
from tests.events import of_kind

pytestmark = pytest.mark.fault

STEPS = 8


def _config(tmp_path, chaos=(), workers=4, replicas=2, stage=1, checkpoint=None,
            steps=STEPS, run="run") -> FitConfig:
    return FitConfig(scaling=ScalingConfig(num_workers=workers, min_workers=1),
                     batch=BatchConfig(global_batch_size=sharding.B),
                     failure=elastic.FailureConfig(replace_lost_workers=False),
                     training=TrainingConfig(clip_grad_norm=0.5),
                     sharding=ShardingConfig(stage=stage, replicas=replicas),
                     max_steps=steps, seed=sharding.SEED, steps_per_chunk=2, ledger=True,
                     run_dir=str(tmp_path / run), chaos=chaos, checkpoint=checkpoint)


def _assert_reference(result, steps=STEPS):
    expected = sharding.reference(sharding.adamw, steps)
    for key, value in expected.items():
        torch.testing.assert_close(result.model_state[key], value, rtol=1e-5, atol=1e-5, msg=key)


def _assert_every_sample_once(result):
    ledger = [json.loads(line) for line in open(os.path.join(result.run_dir, "ledger.jsonl"))]
    assert [entry["step"] for entry in ledger] == list(range(result.steps))
    per_epoch = sharding.N // sharding.B
    for epoch in range(result.steps // per_epoch):
        seen = sorted(i for entry in ledger if entry["epoch"] == epoch for i in entry["indices"])
        assert seen == list(range(sharding.N))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_lost_owners_parts_come_from_their_other_owner_even_mid_gather(ray_cluster, tmp_path,
                                                                       stage):
    # The gather kill comes while the warm-up still moves the learning rate: the survivors
    # finish that step's schedule only once the next generation has the whole model.
    chaos = (ChaosEvent(step=1, rank=0, action="kill", phase="gather"),
             ChaosEvent(step=4, rank=1, action="kill", phase="backward"))
    result = elastic.fit(sharding.job(), _config(tmp_path, chaos, stage=stage))
    assert result.steps == STEPS
    failures = of_kind(result.events, WorkerFailure)
    assert [(f.lost_ranks, f.step) for f in failures] == [([0], 2), ([1], 4)]
    assert not of_kind(result.events, RestoredFromCheckpoint)  # peers only
    assert [g.shard_copies for g in of_kind(result.events, Generation)] == [2, 2, 2]
    assert [g.world_size for g in of_kind(result.events, Generation)] == [4, 3, 2]
    _assert_reference(result)
    _assert_every_sample_once(result)


@pytest.mark.timeout(300)
def test_every_owner_of_a_part_lost_restores_the_checkpoint(ray_cluster, tmp_path):
    checkpoint = CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=2, sign=False,
                                  async_write=False)
    chaos = (ChaosEvent(step=5, rank=1, action="kill", phase="backward"),)
    result = elastic.fit(sharding.job(), _config(tmp_path, chaos, workers=3, replicas=1,
                                                 checkpoint=checkpoint))
    assert result.steps == STEPS
    lost = of_kind(result.events, ShardsLost)
    assert len(lost) == 1 and lost[0].step == 5 and lost[0].parts
    restored = of_kind(result.events, RestoredFromCheckpoint)
    assert [r.step for r in restored] == [4]
    _assert_reference(result)
    _assert_every_sample_once(result)


@pytest.mark.timeout(300)
def test_a_stage_2_checkpoint_holds_the_whole_optimizer_state_and_resumes_at_stages_0_and_1(
        ray_cluster, tmp_path):
    # Written in the background: each owner's shard, then the manifest once all are on disk.
    checkpoint = CheckpointConfig(path=str(tmp_path / "ckpt"), every_steps=2, sign=False,
                                  async_write=True, keep_last=5)
    elastic.fit(sharding.job(), _config(tmp_path, workers=3, stage=2, checkpoint=checkpoint,
                                        steps=4))
    loaded = elastic.load_checkpoint(checkpoint.path, signed=False)
    assert loaded.step == 4
    # In the optimizer's order (its parameter groups), as one unsharded AdamW saves it.
    params = [p for g in sharding.adamw(sharding.model()).param_groups for p in g["params"]]
    state = loaded.parts["optimizer"]["state"]
    assert sorted(state) == list(range(len(params)))  # every parameter's state, once
    for index, p in enumerate(params):
        assert state[index]["exp_avg"].shape == state[index]["exp_avg_sq"].shape == p.shape
    # Written by the owners: one shard file per member, each part in one of them, each file
    # with its checksum in the manifest; optimizer.pt holds the groups only.
    shards = loaded.manifest["shards"]
    assert len(shards) == 3
    assert sorted(i for ids in shards.values() for i in ids) == list(range(len(params)))
    for name in shards:
        assert f"{name}.pt" in loaded.manifest["files"]
    saved = torch.load(os.path.join(loaded.path, "optimizer.pt"), weights_only=True)
    assert saved["state"] == {} and saved["param_groups"]
    # A copy of the folder for the second resume (the first writes on in its own).
    copy = CheckpointConfig(**{**checkpoint.model_dump(), "path": str(tmp_path / "ckpt-copy")})
    shutil.copytree(checkpoint.path, copy.path)
    # Resumed by one stage-0 worker, and by two stage-1 workers: each ends on the
    # uninterrupted loop.
    resumed = elastic.fit(sharding.job(), _config(tmp_path, workers=1, replicas=1, stage=0,
                                                  checkpoint=checkpoint, run="resumed"))
    assert resumed.steps == STEPS
    _assert_reference(resumed)
    again = elastic.fit(sharding.job(), _config(tmp_path, workers=2, stage=1, checkpoint=copy,
                                                run="resumed-1"))
    assert again.steps == STEPS
    assert [r.step for r in of_kind(again.events, Resumed)] == [4]
    _assert_reference(again)


@pytest.mark.timeout(300)
def test_a_preempted_worker_hands_the_only_copy_of_its_parts_over_before_it_goes(
        ray_cluster, tmp_path):
    # One owner per part and no checkpoint: a part lost with the leaver would end the run.
    chaos = (ChaosEvent(step=3, rank=1, action="preempt"),)
    result = elastic.fit(sharding.job(), _config(tmp_path, chaos, workers=3, replicas=1))
    assert result.steps == STEPS
    [departure] = of_kind(result.events, PlannedDeparture)
    assert departure.steps_redone == 0
    assert not of_kind(result.events, RestoredFromCheckpoint)
    assert not of_kind(result.events, WorkerFailure)
    generations = of_kind(result.events, Generation)
    reasons = [g.reason for g in generations]
    i = reasons.index("hand_over")
    assert generations[i].world_size == 3 and reasons[i + 1] == "departure"
    assert generations[i + 1].world_size == 2
    _assert_reference(result)
    _assert_every_sample_once(result)


@pytest.mark.timeout(300)
def test_a_replacement_joins_a_stage_2_run_and_takes_its_share(ray_cluster, tmp_path):
    # min_workers 3: after the kill the run waits for the replacement, so it surely joins.
    chaos = (ChaosEvent(step=2, rank=2, action="kill", phase="backward"),)
    config = _config(tmp_path, chaos, workers=3, stage=2).model_copy(update={
        "scaling": ScalingConfig(num_workers=3, min_workers=3),
        "failure": elastic.FailureConfig(replace_lost_workers=True)})
    result = elastic.fit(sharding.job(), config)
    assert result.steps == STEPS
    assert of_kind(result.events, WorkerJoined)
    assert not of_kind(result.events, RestoredFromCheckpoint)  # the survivors held it all
    assert [g.world_size for g in of_kind(result.events, Generation)][-1] == 3
    _assert_reference(result)
    _assert_every_sample_once(result)
