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
    # Trainer refuses an evaluation strategy without an eval_dataset (nothing would run).
    with pytest.raises(ConfigError, match=r"eval_strategy='epoch' but no eval_dataset"):
        hf_job(hf_setup.gpt2, hf_setup.arguments(str(tmp_path)), hf_setup.Tokens(hf_setup.N, 1))


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


def _bert(kind):
    from transformers import BertConfig, BertForMaskedLM, BertForTokenClassification

    config = BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                        intermediate_size=16, vocab_size=hf_setup.VOCAB,
                        max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=hf_setup.VOCAB)
    return (BertForMaskedLM if kind == "masked_lm" else BertForTokenClassification)(config)


def _split_gradient(job, model, batch, pieces):
    """The gradient elastic sums from micro-batches `pieces` (index lists) of `batch`: each
    piece's `LossSum` total over the global count, or its mean times its share."""
    model.zero_grad()
    outs = [job.loss(model, {k: v[p] for k, v in batch.items()}) for p in pieces]
    count = sum(o.count for o in outs if isinstance(o, LossSum))
    for p, o in zip(pieces, outs, strict=True):
        (o.total / count if isinstance(o, LossSum) else o * len(p) / len(batch["labels"])).backward()
    return [q.grad.clone() for q in model.parameters() if q.grad is not None]


@pytest.mark.parametrize("kind", ["masked_lm", "token_classification"])
def test_a_models_own_token_mean_is_summed_over_tokens_so_any_split_gives_trainers_update(
        tmp_path, kind):
    # BERT's heads compute their own CrossEntropyLoss mean over the tokens that count:
    # Trainer's update (no accumulation) is that mean over the whole batch. Before, each
    # micro-batch's token mean was weighted by its samples: the update followed the split.
    job = hf_job(lambda: _bert(kind), hf_setup.arguments(str(tmp_path), eval_strategy="no",
                                                        gradient_accumulation_steps=1),
                 hf_setup.Tokens(8, 1))
    torch.manual_seed(0)
    model = job.model()
    data = hf_setup.Tokens(8, 1, varied=True)
    batch = job.collate_fn([data[i] for i in range(4)])
    out = job.loss(model, batch)
    assert isinstance(out, LossSum) and int(out.count) == int(batch["labels"].ne(-100).sum())
    torch.testing.assert_close(out.total / out.count, model(**batch).loss)
    model.zero_grad()
    model(**batch).loss.backward()
    whole = [q.grad.clone() for q in model.parameters() if q.grad is not None]
    for pieces in ([[0, 1, 2, 3]], [[0], [1, 2, 3]], [[0, 1], [2, 3]]):
        for a, b in zip(_split_gradient(job, model, batch, pieces), whole, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_loss_that_is_not_the_token_cross_entropy_is_trained_as_before_with_a_warning(tmp_path):
    class Weighted(torch.nn.Module):  # a token loss of its own making (class weights)
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(hf_setup.VOCAB, hf_setup.VOCAB)

        def forward(self, input_ids, labels=None):
            logits = self.embed(input_ids)
            weight = torch.linspace(0.5, 2.0, hf_setup.VOCAB)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, hf_setup.VOCAB),
                                                     labels.reshape(-1), weight=weight)
            return {"loss": loss, "logits": logits}

    job = hf_job(Weighted, hf_setup.arguments(str(tmp_path), gradient_accumulation_steps=1,
                                          eval_strategy="no"),
                 hf_setup.Tokens(8, 1))
    data = hf_setup.Tokens(8, 1)
    batch = job.collate_fn([data[i] for i in range(4)])
    model = job.model()
    from elastic.integrations import huggingface

    huggingface._WARNED.clear()  # once per process: whichever test warned first
    with pytest.warns(UserWarning, match="is not the mean cross-entropy of its logits"):
        out = job.loss(model, batch)  # trained as before, as a mean per sample
    torch.testing.assert_close(out, model(**batch)["loss"])
    # Decided once: a micro-batch without a token that counts is a zero of the same form.
    masked = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    empty = job.loss(model, masked)
    assert not isinstance(empty, LossSum) and float(empty.detach()) == 0.0


def test_a_shifted_causal_lm_that_takes_no_loss_kwargs_is_summed_over_its_shifted_tokens(
        tmp_path):
    # Vision-language LMs (Qwen2.5-VL, Gemma 4) set accepts_loss_kwargs = False: their own
    # loss is a causal LM's token mean, over the labels shifted by one.
    class Causal(torch.nn.Module):
        accepts_loss_kwargs = False

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(hf_setup.VOCAB, hf_setup.VOCAB)

        def forward(self, input_ids, labels=None):
            logits = self.embed(input_ids)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, hf_setup.VOCAB), labels[:, 1:].reshape(-1))
            return {"loss": loss, "logits": logits}

    job = hf_job(Causal, hf_setup.arguments(str(tmp_path), gradient_accumulation_steps=1,
                                          eval_strategy="no"),
                 hf_setup.Tokens(8, 1))
    data = hf_setup.Tokens(8, 1, varied=True)
    batch = job.collate_fn([data[i] for i in range(4)])
    model = job.model()
    out = job.loss(model, batch)
    assert int(out.count) == int(batch["labels"][:, 1:].ne(-100).sum())
    torch.testing.assert_close(out.total / out.count, model(**batch)["loss"])
    # A micro-batch without a token that counts: nothing to compare, nothing to add.
    masked = {**batch, "labels": torch.full_like(batch["labels"], -100)}
    empty = job.loss(model, masked)
    assert int(empty.count) == 0 and float(empty.total.detach()) == 0.0


def test_a_generic_token_classifier_is_trained_on_its_mean_which_ignores_the_item_count(
        tmp_path):
    # Llama's (and 70 other models') token classification head calls its loss function
    # without num_items_in_batch: its loss is a mean whatever Trainer passes. Before, it was
    # taken for a token sum (its name is ForTokenClassification) and divided again by the
    # count: gradients hundreds of times too small.
    from transformers import LlamaConfig, LlamaForTokenClassification

    def classifier():
        return LlamaForTokenClassification(LlamaConfig(
            num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=16, vocab_size=hf_setup.VOCAB, num_labels=hf_setup.VOCAB,
            max_position_embeddings=16, pad_token_id=0, classifier_dropout=0.0))

    job = hf_job(classifier, hf_setup.arguments(str(tmp_path), gradient_accumulation_steps=1,
                                          eval_strategy="no"),
                 hf_setup.Tokens(8, 1))
    torch.manual_seed(0)
    model = job.model()
    assert model.loss_function.__name__ == "ForTokenClassification"  # the name that misled
    data = hf_setup.Tokens(8, 1, varied=True)
    batch = job.collate_fn([data[i] for i in range(4)])
    out = job.loss(model, batch)
    torch.testing.assert_close(out.total / out.count, model(**batch).loss)


def test_accumulated_batches_of_a_model_that_takes_no_loss_kwargs_are_groups(tmp_path):
    # Trainer divides each accumulated batch's own mean by the accumulation steps: the
    # average of per-device means, which groups of per_device_train_batch_size reproduce.
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(hf_setup.VOCAB, hf_setup.VOCAB)

        def forward(self, input_ids, labels=None):  # no **kwargs: Trainer passes no count
            logits = self.embed(input_ids)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, hf_setup.VOCAB),
                                                     labels.reshape(-1))
            return {"loss": loss, "logits": logits}

    job = hf_job(Plain, hf_setup.arguments(str(tmp_path), eval_strategy="no"),
                 hf_setup.Tokens(8, 1))
    assert job.settings["batch.groups"] == "on"
    assert job.settings["batch.group_size"] == hf_setup.PER_DEVICE
    data = hf_setup.Tokens(8, 1)
    batch = job.collate_fn([data[i] for i in range(4)])
    out = job.loss(job.model(), batch)  # a group's own mean, as Trainer takes it
    assert isinstance(out, torch.Tensor) and out.dim() == 0
    assert "batch.groups" not in _job(tmp_path).settings  # GPT-2: a token sum, any split


def test_evaluation_takes_a_tuple_output_as_trainer_does(tmp_path):
    class Tupled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(hf_setup.VOCAB, hf_setup.VOCAB)

        def forward(self, input_ids, labels=None):
            logits = self.embed(input_ids)
            if labels is None:
                return (logits,)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, hf_setup.VOCAB),
                                                     labels.reshape(-1))
            return loss, logits

    seen = []

    def metrics(prediction):
        seen.append(prediction.predictions.shape)
        return {"one": 1.0}

    job = hf_job(Tupled, hf_setup.arguments(str(tmp_path), gradient_accumulation_steps=1),
                 hf_setup.Tokens(8, 1), eval_dataset=hf_setup.Tokens(8, 2),
                 compute_metrics=metrics)
    data = hf_setup.Tokens(8, 2)
    batch = job.collate_fn([data[i] for i in range(4)])
    model = job.model()
    terms = job.eval_step(model, batch)
    torch.testing.assert_close(terms["loss"][0] / 4, model(**batch)[0].double())
    assert seen == [(4, hf_setup.SEQ, hf_setup.VOCAB)]


def test_evaluation_predictions_are_trainers_with_hidden_states_and_without_the_cache(tmp_path):
    # A GPT-2 that returns its hidden states: Trainer's predictions are (logits, hidden
    # states), the cache left out (`keys_to_ignore_at_inference`); before, only the logits,
    # so a compute_metrics written for Trainer unpacked another structure.
    from transformers import Trainer

    def gpt2_states():
        model = hf_setup.gpt2()
        model.config.output_hidden_states = True
        return model

    seen = []

    def metrics(prediction):
        seen.append(prediction.predictions)
        return {"one": 1.0}

    args = hf_setup.arguments(str(tmp_path), gradient_accumulation_steps=1)
    job = hf_job(gpt2_states, args, hf_setup.Tokens(8, 1), eval_dataset=hf_setup.Tokens(8, 2),
                 compute_metrics=metrics)
    data = hf_setup.Tokens(8, 2)
    batch = job.collate_fn([data[i] for i in range(4)])
    model = job.model()
    model.eval()
    job.eval_step(model, batch)
    trainer = Trainer(model=model, args=args, eval_dataset=data)
    _, logits, _ = trainer.prediction_step(model, dict(batch), prediction_loss_only=False)
    [ours] = seen
    assert isinstance(logits, tuple) and isinstance(ours, tuple) and len(ours) == len(logits) == 2
    assert len(ours[1]) == len(logits[1]) == 3  # the embeddings' and two layers' states
    torch.testing.assert_close(torch.from_numpy(ours[0]), logits[0].float())
    for mine, theirs in zip(ours[1], logits[1], strict=True):
        torch.testing.assert_close(torch.from_numpy(mine), theirs.float())


def test_a_per_sample_loss_with_accumulation_is_refused_as_trainer_would_scale_it(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    def classifier():
        return BertForSequenceClassification(BertConfig(
            num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16,
            vocab_size=50))

    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2: this model takes "
                                          "num_items_in_batch but its loss is a per-batch mean"):
        hf_job(classifier, hf_setup.arguments(str(tmp_path), eval_strategy="no"),
               hf_setup.Tokens(8, 1))
    job = hf_job(classifier, hf_setup.arguments(str(tmp_path), gradient_accumulation_steps=1,
                                          eval_strategy="no"),
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
    ({"lr_scheduler_type": "greedy"}, "lr_scheduler_type=.* metric_for_best_model"),
    ({"load_best_model_at_end": True, "save_strategy": "epoch",
      "metric_for_best_model": "accuracy"}, r"load_best_model_at_end=True .* best=True"),
    ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha=5.0 .* in the model's forward"),
    ({"use_liger_kernel": True}, "use_liger_kernel=True is not supported by elastic: .* train "
                                 "without them"),
])
def test_what_elastic_cannot_do_alike_is_refused_by_name(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _job(tmp_path, **overrides)


# --- found by a review against transformers 5.24.0: what Trainer does and hf_job did not ----


class _Flags:
    """The model's checkpointing state, per module: `gradient_checkpointing` and the keyword
    arguments its checkpoint function was given."""

    @staticmethod
    def of(model):
        return {name: (m.gradient_checkpointing,
                       getattr(getattr(m, "_gradient_checkpointing_func", None), "keywords", None))
                for name, m in model.named_modules() if hasattr(m, "gradient_checkpointing")}


@pytest.mark.parametrize("spelling", ["activation_checkpointing", "gradient_checkpointing"])
def test_activation_checkpointing_is_turned_on_as_trainer_turns_it_on(tmp_path, spelling):
    # Before, the argument was ignored: the model kept every activation.
    from transformers import Trainer

    args = hf_setup.arguments(str(tmp_path), max_steps=1, eval_strategy="no", **{
        spelling: True, f"{spelling}_kwargs": {"use_reentrant": False, "every_n_layers": 2}})
    trainer = Trainer(model_init=hf_setup.gpt2, args=args,
                      train_dataset=hf_setup.Tokens(hf_setup.GLOBAL, 1))
    trainer.train()  # Trainer turns it on in train()
    model = hf_job(hf_setup.gpt2, args, hf_setup.Tokens(hf_setup.N, 1)).model()
    assert model.is_activation_checkpointing
    assert _Flags.of(model) == _Flags.of(trainer.model)
    flags = _Flags.of(model)  # every second layer: the first of GPT-2's two
    assert (flags["transformer.h.0"], flags["transformer.h.1"]) == (
        (True, {"use_reentrant": False}), (False, {"use_reentrant": False}))


def test_activation_checkpointing_on_a_model_that_cannot_is_refused_by_name(tmp_path):
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(hf_setup.VOCAB, hf_setup.VOCAB)

        def forward(self, input_ids, labels=None):
            return {"loss": self.embed(input_ids).mean()}

    args = hf_setup.arguments(str(tmp_path), eval_strategy="no", gradient_accumulation_steps=1,
                              activation_checkpointing=True)
    with pytest.raises(ConfigError, match=r"activation_checkpointing=True: Plain cannot checkpoint "
                                          r".* set activation_checkpointing=False"):
        hf_job(Plain, args, hf_setup.Tokens(8, 1))


class _Spans(torch.utils.data.Dataset):
    """Question-answering samples: token ids and an answer span, no "labels"."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, hf_setup.VOCAB, (n, hf_setup.SEQ), generator=g)
        self.start = torch.randint(0, hf_setup.SEQ // 2, (n,), generator=g)
        self.end = self.start + torch.randint(0, hf_setup.SEQ // 2, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "start_positions": self.start[i],
                "end_positions": self.end[i]}


def _question_answering():
    from transformers import BertConfig, BertForQuestionAnswering

    return BertForQuestionAnswering(BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16,
        vocab_size=hf_setup.VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def test_accumulation_without_labels_in_the_batch_is_trainers_mean_over_the_global_batch(
        tmp_path):
    # Trainer counts items only in batches with "labels": a question-answering head (which
    # takes loss keyword arguments) is then divided by the accumulation steps, a plain mean.
    # Before, it was refused as if Trainer passed it a count.
    from transformers import Trainer, TrainerCallback

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]

    args = hf_setup.arguments(str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                              gradient_accumulation_steps=2, max_grad_norm=0.0,
                              eval_strategy="no", label_names=["start_positions", "end_positions"])
    data = _Spans(4, 1)
    torch.manual_seed(0)
    model = _question_answering()
    recorder = Gradients()
    trainer = Trainer(model=_question_answering(), args=args, train_dataset=data,
                      callbacks=[recorder])
    trainer.model.load_state_dict(model.state_dict())
    trainer.train()
    job = hf_job(_question_answering, args, data)
    assert job.settings["batch.global_batch_size"] == 4 and "batch.groups" not in job.settings
    batch = job.collate_fn([data[i] for i in range(4)])
    for pieces in ([[0, 1, 2, 3]], [[0], [1, 2, 3]]):  # any split: each mean times its share
        model.zero_grad()
        for p in pieces:
            (job.loss(model, {k: v[p] for k, v in batch.items()}) * len(p) / 4).backward()
        ours = [q.grad for q in model.parameters() if q.grad is not None]
        for a, b in zip(ours, recorder.grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_accumulation_with_a_model_of_its_own_and_no_labels_gives_trainers_groups(tmp_path):
    class Named(torch.nn.Module):  # takes **kwargs, so Trainer would pass a count with labels
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(hf_setup.VOCAB, hf_setup.VOCAB)

        def forward(self, input_ids, targets=None, **kwargs):
            logits = self.embed(input_ids)
            return {"loss": torch.nn.functional.cross_entropy(
                logits.reshape(-1, hf_setup.VOCAB), targets.reshape(-1)), "logits": logits}

    class Targets(hf_setup.Tokens):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return {"input_ids": sample["input_ids"], "targets": sample["labels"]}

    job = hf_job(Named, hf_setup.arguments(str(tmp_path), eval_strategy="no",
                                           label_names=["targets"]), Targets(8, 1))
    assert (job.settings["batch.groups"], job.settings["batch.group_size"]) == (
        "on", hf_setup.PER_DEVICE)


class _Sentences(torch.utils.data.Dataset):
    """Tokenized sentences of different lengths, unpadded, with a class label."""

    def __init__(self, tokenizer):
        texts = ["w1 w2", "w3 w4 w5 w6", "w7", "w2 w5 w8"]
        self.samples = [{**tokenizer(t), "label": i % 2} for i, t in enumerate(texts)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[SEP]": 1, "[CLS]": 2, "[PAD]": 3, **{f"w{i}": i + 4 for i in range(10)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")


def _classifier():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16,
        vocab_size=16, max_position_embeddings=16, pad_token_id=0))


def test_a_tokenizer_pads_the_batches_and_sets_the_pad_token_as_trainers(tmp_path):
    # Before, hf_job took no processing_class and collated with default_data_collator,
    # which fails on sentences of different lengths.
    from transformers import Trainer
    from transformers.trainer_utils import align_special_tokens

    tokenizer = _tokenizer()
    data = _Sentences(tokenizer)
    args = hf_setup.arguments(str(tmp_path), eval_strategy="no", gradient_accumulation_steps=1)
    trainer = Trainer(model=_classifier(), args=args, train_dataset=data,
                      processing_class=tokenizer)
    job = hf_job(_classifier, args, data, processing_class=tokenizer)
    samples = [data[i] for i in range(4)]
    ours, theirs = job.collate_fn(samples), trainer.data_collator(samples)
    assert set(ours) == set(theirs) == {"input_ids", "attention_mask", "labels"}
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key])
    reference = _classifier()
    align_special_tokens(reference, tokenizer)  # what Trainer.train does with a tokenizer
    assert job.model().config.pad_token_id == reference.config.pad_token_id == 3
