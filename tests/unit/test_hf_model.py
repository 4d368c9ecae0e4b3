"""A Hugging Face causal LM (`examples/hf_gpt2.py`: a tiny GPT-2 with dropout, a padded token
dataset, the loss as `LossSum(out.loss with num_items_in_batch=1, shifted label count)`)
trained elastically ends with the weights of one plain-PyTorch process, whatever the world
size, the shares, a kill or a resize; the harness and the reference are those of
`test_split_independence.py` and `tests/fidelity.py`.

The example's AdamW is swapped for SGD with momentum: GPT-2's attention key bias has a gradient
of exactly 0 (softmax ignores a shift common to every key), so what it gets is rounding noise
that depends on the summation order, and Adam, dividing by the root of the squared gradient,
turns that noise into steps of up to lr * noise / eps (3.5e-6 after six steps here, against
1.2e-7 on every other tensor). SGD leaves noise as noise (1.5e-8)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from examples import hf_gpt2
from tests.fidelity import reference, sgd
from tests.unit.test_split_independence import SEED, B, G, _elastic

STEPS = 6

SCHEDULES = {
    "uninterrupted": [(4, STEPS, None)],
    "kill": [(4, 2, None), (3, 4, None)],
    "resize": [(2, 3, None), (3, 1, [1.0, 2.0, 1.0]), (4, 2, None)],
}


def _assert_same_state(final: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        if value.is_floating_point():
            torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-5, msg=key)
        else:
            assert torch.equal(final[key], value), key


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


def _job():
    return dataclasses.replace(hf_gpt2.job(), optimizer=sgd)


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return reference(_job(), SEED, B, G, STEPS)


def test_the_example_loss_is_the_summed_token_loss_over_the_shifted_labels():
    torch.manual_seed(SEED)
    model = hf_gpt2.gpt2().eval()
    ids, mask, labels = hf_gpt2.sequences()[:G]
    out = hf_gpt2.loss(model, (ids, mask, labels))
    logits = model(input_ids=ids, attention_mask=mask).logits
    manual = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                               ignore_index=hf_gpt2.IGNORE, reduction="sum")
    assert int(out.count) == int(mask[:, 1:].sum()) > 0
    torch.testing.assert_close(out.total, manual, rtol=1e-6, atol=1e-5)
    assert sum(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_gpt2_trained_elastically_ends_with_the_weights_of_one_plain_process(tmp_path, schedule, expected):
    final = _elastic(tmp_path, _job(), SCHEDULES[schedule])
    _assert_same_state(final, expected)


def _token_mean(model, batch):
    ids, mask, labels = batch
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


@pytest.mark.timeout(180)
def test_the_reference_tells_a_per_forward_token_mean_from_the_global_one(tmp_path, expected):
    """The oracle can fail: `out.loss` without `num_items_in_batch` is a token mean per forward
    (per group here), which weighs a token by how few tokens share its forward. That run
    matches its own reference (so the gap is the loss's normalisation, not noise) and is
    farther than 1e-4 from the global token mean's."""
    mean_job = dataclasses.replace(_job(), loss=_token_mean)
    final = _elastic(tmp_path, mean_job, [(3, STEPS, [3.0, 1.0, 2.0])])
    _assert_same_state(final, reference(mean_job, SEED, B, G, STEPS))
    assert _worst(final, expected) > 1e-4


def _masked_lm():
    from transformers import BertConfig, BertForMaskedLM

    from tests import hf_setup

    return BertForMaskedLM(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                      intermediate_size=16, vocab_size=hf_setup.VOCAB,
                                      max_position_embeddings=16, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


@pytest.mark.timeout(180)
def test_a_bert_masked_lm_through_a_kill_and_a_resize_ends_on_trainers_weights(tmp_path):
    """BERT's masked LM computes its own token mean (no loss keyword arguments reach it):
    `Trainer`'s update is that mean over the whole batch. `hf_job` sums the same
    cross-entropy over tokens, so elastic at 4, 3 and 2 workers, with uneven shares, ends on
    the weights of `transformers.Trainer` in one process fed the public order. Before, each
    micro-batch's token mean was weighed by its samples and the weights followed the split
    (the sequences count 4 to 8 labelled tokens each)."""
    from elastic.integrations.huggingface import hf_job
    from tests import hf_setup

    args = hf_setup.arguments(str(tmp_path / "trainer"), per_device_train_batch_size=B,
                              gradient_accumulation_steps=1, max_steps=STEPS, optim="sgd",
                              learning_rate=0.5, max_grad_norm=0.0, seed=SEED,
                              eval_strategy="no", warmup_steps=2)
    train = hf_setup.Tokens(2 * B, 5, varied=True)
    job = hf_job(_masked_lm, args, train)
    final = _elastic(tmp_path / "elastic", job, [(4, 2, None), (3, 2, [3.0, 1.0, 2.0]),
                                                 (2, 2, None)])
    trainer = hf_setup.public_order_trainer(args, train, None, model_init=_masked_lm,
                                            compute_metrics=None)
    trainer.train()
    expected = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    assert _worst(final, expected) > 0  # trained, not the initial weights twice
    _assert_same_state(final, expected)
