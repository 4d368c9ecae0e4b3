"""The Hugging Face adapter without Ray: what `hf_job` takes from TrainingArguments (the
job's settings), Trainer's optimizer groups and loss form, the dropped columns, and each
refusal's message. The end-to-end oracle against `transformers.Trainer` is in
tests/integration/test_huggingface.py."""

from __future__ import annotations

import pytest
import torch

from elastic import LossSum
from elastic.errors import ConfigError

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from elastic.integrations.huggingface import hf_job
from tests import hf_setup


def _job(tmp_path, **overrides):
    return hf_job(hf_setup.gpt2, hf_setup.arguments(str(tmp_path), **overrides),
                  hf_setup.Tokens(hf_setup.N, 1), eval_dataset=hf_setup.Tokens(hf_setup.N_EVAL, 2),
                  compute_metrics=hf_setup.accuracy)


def test_training_arguments_become_the_jobs_settings(tmp_path):
    assert _job(tmp_path).settings == {
        "batch.global_batch_size": 8, "batch.max_micro_batch": 4, "seed": 0, "epochs": 2,
        "training.clip_grad_norm": 0.5, "evaluation.batch_size": 4}
    steps = _job(tmp_path, max_steps=5, bf16=True, eval_strategy="steps", eval_steps=3, seed=7,
                 gradient_accumulation_steps=1, max_grad_norm=0.0).settings
    assert steps == {"batch.global_batch_size": 4, "seed": 7, "max_steps": 5,
                     "training.precision": "bf16-mixed", "evaluation.batch_size": 4,
                     "evaluation.every_steps": 3}
    assert _job(tmp_path, eval_strategy="no").eval_step is None


def test_the_optimizer_and_scheduler_are_trainers(tmp_path):
    job = _job(tmp_path)
    model = job.model()
    optimizer = job.optimizer(model)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, plain = ([names[id(p)] for p in g["params"]] for g in optimizer.param_groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(not n.endswith("bias") and ".ln_" not in n for n in decayed)
    assert any(n.endswith("bias") for n in plain) and any(".ln_1." in n for n in plain)
    assert type(optimizer).__name__ == "AdamW"
    scheduler = job.lr_scheduler(optimizer)
    lrs = []
    for _ in range(8):  # 2 warm-up steps, then a cosine to 0 at step 8
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == 0 and lrs[2] == pytest.approx(3e-3) and lrs[1] == pytest.approx(1.5e-3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_a_token_loss_is_a_sum_and_count_and_unused_columns_are_dropped(tmp_path):
    job = _job(tmp_path)
    torch.manual_seed(0)
    model = job.model()
    data = hf_setup.Tokens(hf_setup.N, 1, varied=True)
    batch = job.collate_fn([data[i] for i in range(8)])
    assert set(batch) == {"input_ids", "labels"}  # "source" is not a forward argument
    out = job.loss(model, batch)
    assert isinstance(out, LossSum)
    labels = batch["labels"]
    # Trainer's count for GPT-2 (whose loss_type is unset): every label that is not -100,
    # unshifted; the sum is over the shifted labels, as the model's loss takes them.
    assert int(out.count) == int(labels.ne(-100).sum()) != int(labels[:, 1:].ne(-100).sum())
    shifted = labels[:, 1:].ne(-100).sum()
    torch.testing.assert_close(out.total / shifted, model(**batch).loss)
    per_sequence = labels[:, 1:].ne(-100).sum(1)
    assert len(set(per_sequence.tolist())) > 1  # a mean per sequence would weigh them alike


def test_a_model_that_computes_its_own_mean_loss_is_trained_on_that_mean(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    def masked_lm():  # its forward uses its own CrossEntropyLoss, not self.loss_function
        return BertForMaskedLM(BertConfig(num_hidden_layers=1, hidden_size=16,
                                          num_attention_heads=2, intermediate_size=16,
                                          vocab_size=hf_setup.VOCAB, max_position_embeddings=16,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    job = hf_job(masked_lm, hf_setup.arguments(str(tmp_path), gradient_accumulation_steps=1),
                 hf_setup.Tokens(8, 1))
    model = job.model()
    data = hf_setup.Tokens(8, 1)
    batch = job.collate_fn([data[i] for i in range(4)])
    out = job.loss(model, batch)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, model(**batch).loss)


def test_a_per_sample_loss_with_accumulation_is_refused_as_trainer_would_scale_it(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    def classifier():
        return BertForSequenceClassification(BertConfig(
            num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16,
            vocab_size=50))

    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2: this model takes "
                                          "num_items_in_batch but its loss is a per-batch mean"):
        hf_job(classifier, hf_setup.arguments(str(tmp_path)), hf_setup.Tokens(8, 1))
    job = hf_job(classifier, hf_setup.arguments(str(tmp_path), gradient_accumulation_steps=1),
                 hf_setup.Tokens(8, 1))
    assert "batch.max_micro_batch" not in job.settings


@pytest.mark.parametrize(("field", "value", "message"), [
    ("deepspeed", {"zero_optimization": {"stage": 2}}, "ShardingConfig"),
    ("fsdp", "full_shard", "data-parallel"),
    ("group_by_length", True, "public order"),
    ("batch_eval_metrics", True, "already called per batch"),
    ("eval_steps", 0.25, "whole number of steps"),
])
def test_a_distributed_or_sampling_argument_is_refused_by_name(tmp_path, field, value, message):
    args = hf_setup.arguments(str(tmp_path), eval_strategy="steps", eval_steps=2)
    object.__setattr__(args, field, value)  # set past __post_init__, which needs their packages
    with pytest.raises(ConfigError, match=rf"TrainingArguments.{field}=.* is not supported by "
                                          rf"elastic: .*{message}"):
        hf_job(hf_setup.gpt2, args, hf_setup.Tokens(hf_setup.N, 1))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1 is not supported"),
    ({"optim": "adamw_bnb_8bit"}, "optim=.* is not supported by elastic: use one of adamw_torch"),
    ({"num_train_epochs": 1.5}, "num_train_epochs=1.5 .* whole number of epochs, or max_steps"),
    ({"torch_compile": True}, "torch_compile=True"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "lr_scheduler_type=.* metric_for_best_model"),
])
def test_what_elastic_cannot_do_alike_is_refused_by_name(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _job(tmp_path, **overrides)
