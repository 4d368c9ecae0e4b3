"""A tiny GPT-2 (Hugging Face transformers, built locally: nothing is downloaded) on synthetic
padded token sequences, its loss in the sum-and-count form:

    elastic run examples/hf_gpt2.py:job --workers 2 --epochs 2 --global-batch 32

`out.loss` is a token mean over one forward's sequences, so averaging it over forwards weighs a
token by how many tokens share its forward, and the update would depend on how the global batch
was split over ranks and micro-batches. With `num_items_in_batch=1` the model returns the summed
token loss instead; `elastic.LossSum(sum, count)` has the step divide the summed gradients by
the global token count, so the update is the same for any split (any world size, any shares).
Needs `pip install 'transformers>=4.46'` (the first version whose causal-LM loss takes
`num_items_in_batch`).
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from elastic import LossSum, TrainJob

VOCAB = 64
SEQ = 16
N = 256
PAD = 0  # the input id at padded positions (masked out of attention and labels)
IGNORE = -100  # the label transformers' loss skips


def sequences() -> TensorDataset:
    """(input ids, attention mask, labels): learnable sequences (a random start, then steps of 1
    to 3 through the tokens 1..VOCAB-1) of 2 to SEQ tokens, right-padded; labels are the input
    ids with IGNORE at padding (the model shifts them by one itself)."""
    g = torch.Generator().manual_seed(11)
    start = torch.randint(0, VOCAB - 1, (N, 1), generator=g)
    stride = torch.randint(1, 4, (N, 1), generator=g)
    ids = 1 + (start + stride * torch.arange(SEQ)[None, :]) % (VOCAB - 1)
    lengths = torch.randint(2, SEQ + 1, (N,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    return TensorDataset(ids, mask, ids.masked_fill(mask == 0, IGNORE))


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # Dropout stays at GPT-2's 0.1 (embeddings, attention, residuals): elastic's groups make it
    # the same for any split. bos/eos inside the small vocabulary. The loss is named on the
    # config and on the model (transformers 4.x reads one, 5.x the other), else it warns.
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, loss_type="ForCausalLM")
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def loss(model: torch.nn.Module, batch) -> LossSum:
    ids, mask, labels = batch
    out = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=1)
    # The causal-LM loss predicts token t+1 from tokens <= t: it sums over labels[:, 1:].
    return LossSum(out.loss, (labels[:, 1:] != IGNORE).sum())


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def job() -> TrainJob:
    return TrainJob(model=gpt2, optimizer=adamw, loss=loss, dataset=sequences)
