"""A Hugging Face Trainer setup runs elastically: the oracle is `transformers.Trainer` itself,
in one process, fed the public sample order. The elastic run goes through a kill and a planned
departure on 3 workers; the setup has warm-up, a cosine schedule, AdamW's decay groups,
clipping, gradient accumulation (the global batch) and a token loss over sequences that count
different numbers of tokens (a per-sequence mean would not give Trainer's weights). The
evaluation set counts the same tokens in every sequence: its batches are cut per rank, and
Trainer weighs each batch's token mean by its sequences."""

from __future__ import annotations

import pytest
import torch

import elastic
from elastic import ChaosEvent, FitConfig, ScalingConfig
from elastic.events import PlannedDeparture, WorkerFailure
from tests.events import of_kind

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from elastic.integrations.huggingface import hf_job
from tests import hf_setup
from tests.oracles import assert_every_sample_once_per_epoch, evaluations_by_step, with_evaluations

pytestmark = pytest.mark.integration

EPOCHS = 2
STEPS = EPOCHS * (hf_setup.N // hf_setup.GLOBAL)


def _trainer_reference(tmp_path):
    train, evaluation = hf_setup.Tokens(hf_setup.N, 1, varied=True), hf_setup.Tokens(hf_setup.N_EVAL, 2)
    trainer = hf_setup.public_order_trainer(hf_setup.arguments(str(tmp_path / "hf")), train,
                                            evaluation)
    trainer.train()
    evaluations = [e for e in trainer.state.log_history if "eval_loss" in e]
    return trainer.model.state_dict(), evaluations


@pytest.mark.timeout(300)
def test_a_trainer_setup_through_a_kill_and_a_departure_ends_on_trainers_weights(ray_cluster, tmp_path):
    args = hf_setup.arguments(str(tmp_path / "hf"))
    job = hf_job(hf_setup.gpt2, args, hf_setup.Tokens(hf_setup.N, 1, varied=True),
                 eval_dataset=hf_setup.Tokens(hf_setup.N_EVAL, 2),
                 compute_metrics=hf_setup.accuracy)
    evaluations = str(tmp_path / "evaluations.jsonl")
    job = with_evaluations(job, evaluations)
    chaos = (ChaosEvent(step=2, rank=1, action="kill", phase="backward"),
             ChaosEvent(step=5, rank=0, action="preempt"))
    # The global batch, epochs, seed, clipping and evaluation come from the arguments.
    config = FitConfig.for_job(job, scaling=ScalingConfig(num_workers=3, min_workers=1, max_workers=3),
                               steps_per_chunk=2, run_dir=str(tmp_path / "run"), chaos=chaos,
                               ledger=True)
    assert (config.batch.global_batch_size, config.epochs) == (hf_setup.GLOBAL, EPOCHS)
    result = elastic.fit(job, config)

    expected, trainer_evaluations = _trainer_reference(tmp_path)
    assert result.steps == STEPS
    assert [f.lost_ranks for f in of_kind(result.events, WorkerFailure)] == [[1]]
    assert len(of_kind(result.events, PlannedDeparture)) == 1
    for key, value in expected.items():
        torch.testing.assert_close(result.model_state[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert all("grad_norm" in m for m in result.metrics)  # max_grad_norm: clipping on
    # After each epoch: the loss and compute_metrics over the whole evaluation set.
    by_step = evaluations_by_step(evaluations)
    assert sorted(by_step) == [STEPS // EPOCHS * (e + 1) for e in range(EPOCHS)]
    for step, want in zip(sorted(by_step), trainer_evaluations, strict=True):
        assert by_step[step]["loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
        assert by_step[step]["accuracy"] == pytest.approx(want["eval_accuracy"], rel=1e-5)
    assert_every_sample_once_per_epoch(result.run_dir, STEPS, EPOCHS, hf_setup.N)
