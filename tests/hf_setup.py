"""A Hugging Face Trainer setup for the adapter's tests: a tiny GPT-2 (no dropout: Trainer's
masks come from one global stream), token sequences with some labels masked (-100), and
TrainingArguments with warm-up, a cosine schedule, weight decay and clipping. Built locally,
no downloads. `public_order_trainer` is `transformers.Trainer` fed elastic's public order."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

N, N_EVAL, SEQ, VOCAB = 32, 24, 8, 40
PER_DEVICE, ACCUMULATE = 4, 2
GLOBAL = PER_DEVICE * ACCUMULATE


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class Tokens(Dataset):
    """Token sequences with labels masked (-100) as prompts and padding would mask them.

    `varied`: each sequence's first 0 to 3 labels and, for about a third, its last label are
    masked, so that sequences count different numbers of tokens (a mean per sequence and the
    token mean differ, and so do the shifted and unshifted counts). Otherwise every sequence
    has its first two labels masked."""

    def __init__(self, n: int, seed: int, varied: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.extra = torch.randint(0, 2, (n,), generator=g)  # a column forward does not take
        self.prompt = torch.randint(0, 4, (n,), generator=g) if varied else torch.full((n,), 2)
        self.tail = (torch.rand(n, generator=g) < 0.35) if varied else torch.zeros(n, dtype=torch.bool)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: int(self.prompt[i])] = -100
        if self.tail[i]:
            labels[-1] = -100
        return {"input_ids": self.ids[i], "labels": labels, "source": self.extra[i]}


def arguments(output_dir: str, **overrides):
    from transformers import TrainingArguments

    settings = dict(output_dir=output_dir, per_device_train_batch_size=PER_DEVICE,
                    gradient_accumulation_steps=ACCUMULATE, per_device_eval_batch_size=4,
                    num_train_epochs=2, learning_rate=3e-3, weight_decay=0.1, warmup_steps=2,
                    lr_scheduler_type="cosine", max_grad_norm=0.5, seed=0, eval_strategy="epoch",
                    report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                    disable_tqdm=True)
    settings.update(overrides)
    return TrainingArguments(**settings)


def accuracy(prediction) -> dict[str, float]:
    """Next-token accuracy over the labels that count (a mean over samples per batch)."""
    logits, labels = prediction.predictions, prediction.label_ids
    predicted, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    counted = target != -100
    return {"accuracy": float((predicted == target)[counted].mean())}


class PublicOrder(torch.utils.data.Sampler):
    """elastic's public order, sample by sample: epoch e visits `randperm(N, seed + e)`, the
    last partial global batch dropped. Trainer iterates it once per epoch."""

    def __init__(self, n: int, seed: int = 0, batch: int = GLOBAL) -> None:
        self.n, self.seed, self.epoch, self.batch = n, seed, 0, batch

    def __len__(self) -> int:
        return self.n // self.batch * self.batch

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
        return iter(perm[: len(self)].tolist())


def public_order_trainer(args, train, evaluation, model_init=gpt2, compute_metrics=accuracy):
    from transformers import Trainer

    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps

    class _Trainer(Trainer):
        def _get_train_sampler(self, *_, **__):
            return PublicOrder(len(train), args.seed, batch)

    return _Trainer(model_init=model_init, args=args, train_dataset=train,
                    eval_dataset=evaluation, compute_metrics=compute_metrics)
