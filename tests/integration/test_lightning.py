"""A LightningModule and its data module run elastically: the oracle is `lightning.Trainer`
itself, in one process, fed the public sample order (`ContractBatches`) with the same global
batch. The elastic run goes through a kill and a planned departure on 3 workers."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import elastic
from elastic import BatchConfig, ChaosEvent, FitConfig, ScalingConfig
from elastic.events import PlannedDeparture, WorkerFailure
from tests.events import of_kind

L = pytest.importorskip("lightning.pytorch")

from elastic.integrations.lightning import lightning_job  # noqa: E402
from tests.lightning_modules import ContractBatches, Data, N, Regressor  # noqa: E402
from tests.oracles import (  # noqa: E402
    assert_every_sample_once_per_epoch,
    evaluations_by_step,
    with_evaluations,
)

pytestmark = pytest.mark.integration

B, EPOCHS, CLIP = 12, 3, 0.5
STEPS = EPOCHS * (N // B)


class _Record(L.Callback):
    def __init__(self) -> None:
        self.train, self.val = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train.append(float(trainer.callback_metrics["train_mae"]))

    def on_validation_epoch_end(self, trainer, module):
        self.val.append({k: float(trainer.callback_metrics[k]) for k in ("val_loss", "val_mae")})


def _lightning_reference():
    """`lightning.Trainer.fit` in this process: weights, per-step train_mae, per-epoch val.
    (Not `deterministic=True`: one CPU process is, and Lightning would leave
    `torch.use_deterministic_algorithms` on for every test after this one.)"""
    torch.manual_seed(0)  # elastic builds the model under the run's seed
    module, data = Regressor(), Data()
    data.setup("fit")
    batches = ContractBatches(N, B)
    record = _Record()
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        gradient_clip_val=CLIP, callbacks=[record])
    trainer.fit(module, train_dataloaders=DataLoader(data.train, batch_sampler=batches),
                val_dataloaders=data.val_dataloader())
    assert len(batches.seen) == STEPS and batches.seen[N // B] != batches.seen[0]
    return module.state_dict(), record, module.lr_schedulers().get_last_lr()


@pytest.mark.timeout(300)
def test_a_lightning_module_through_a_kill_and_a_departure_ends_on_lightnings_weights(
        ray_cluster, tmp_path):
    job = lightning_job(Regressor, Data, gradient_clip_val=CLIP, max_epochs=EPOCHS)
    evaluations = str(tmp_path / "evaluations.jsonl")
    job = with_evaluations(job, evaluations)
    chaos = (ChaosEvent(step=4, rank=1, action="kill", phase="backward"),
             ChaosEvent(step=13, rank=0, action="preempt"))
    # The epochs come from the job (max_epochs), the rest from here.
    config = FitConfig.for_job(job, scaling=ScalingConfig(num_workers=3, min_workers=1, max_workers=3),
                               batch=BatchConfig(global_batch_size=B), steps_per_chunk=2,
                               run_dir=str(tmp_path / "run"), chaos=chaos, ledger=True)
    assert config.epochs == EPOCHS and config.training.clip_grad_norm == CLIP
    result = elastic.fit(job, config)

    expected, record, last_lr = _lightning_reference()
    assert result.steps == STEPS
    assert [f.lost_ranks for f in of_kind(result.events, WorkerFailure)] == [[1]]
    assert len(of_kind(result.events, PlannedDeparture)) == 1
    assert len({m["world_size"] for m in result.metrics}) >= 2
    for key, value in expected.items():
        torch.testing.assert_close(result.model_state[key], value, rtol=1e-5, atol=1e-5, msg=key)
    # The step scheduler (frequency 2) and clipping came from the module and the arguments.
    assert result.metrics[-1]["lr"] == pytest.approx(last_lr[0], rel=1e-6)
    assert all("grad_norm" in m for m in result.metrics)
    # self.log in training_step: each step's train_mae, the mean over the global batch.
    by_step = {m["step"]: m["metrics"]["train_mae"] for m in result.metrics}
    assert [by_step[s] for s in range(STEPS)] == pytest.approx(record.train, rel=1e-5, abs=1e-6)
    # self.log in validation_step: after each epoch, over the whole validation set.
    per_epoch = evaluations_by_step(evaluations)
    assert sorted(per_epoch) == [N // B * (e + 1) for e in range(EPOCHS)]
    for got, want in zip([per_epoch[s] for s in sorted(per_epoch)], record.val, strict=True):
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5, abs=1e-6)
        assert got["val_mae"] == pytest.approx(want["val_mae"], rel=1e-5, abs=1e-6)
    # Every sample once per epoch, through the kill and the departure.
    assert_every_sample_once_per_epoch(result.run_dir, STEPS, EPOCHS, N // B * B)
