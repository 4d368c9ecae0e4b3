"""A Hugging Face `Trainer` setup, trained elastically: sentiment of short sentences with a
small BERT built locally (no download), `TrainingArguments` with warm-up, a cosine schedule,
weight decay, clipping and evaluation every epoch with an accuracy metric.

    elastic run examples/hf_text_classification.py:job --workers 2 --kill-at 6:1

Everything but the last lines is what you would hand `transformers.Trainer`; `hf_job` takes
the same `model_init`, arguments, data sets and `compute_metrics`. The global batch
(`per_device_train_batch_size * gradient_accumulation_steps`), the epochs, the seed and the
evaluation come from the arguments.
"""

from __future__ import annotations

import random
import tempfile

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from elastic.integrations.huggingface import hf_job

SUBJECTS = ["the movie", "this film", "the plot", "the acting", "the ending", "the soundtrack"]
GOOD = ["great", "wonderful", "moving", "brilliant", "fun", "superb"]
BAD = ["dull", "awful", "boring", "weak", "painful", "clumsy"]
WORDS = ["[PAD]", "[CLS]", "was", "really", "not", "quite"] + [w for s in SUBJECTS for w in s.split()] \
    + GOOD + BAD
VOCAB = {w: i for i, w in enumerate(dict.fromkeys(WORDS))}
LENGTH = 8


class Sentences(Dataset):
    """Sentences such as "the plot was really brilliant" (label 1) or "this film was not
    fun" (label 0), tokenised by word."""

    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.rows = []
        for _ in range(n):
            good = rng.random() < 0.5
            negated = rng.random() < 0.3
            word = rng.choice(GOOD if good else BAD)
            words = ["[CLS]", *rng.choice(SUBJECTS).split(), "was",
                     *(["not"] if negated else [rng.choice(["really", "quite"])]), word]
            ids = [VOCAB[w] for w in words][:LENGTH]
            mask = [1] * len(ids) + [0] * (LENGTH - len(ids))
            self.rows.append({"input_ids": torch.tensor(ids + [0] * (LENGTH - len(ids))),
                              "attention_mask": torch.tensor(mask),
                              "labels": torch.tensor(int(good != negated))})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def model_init():
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=LENGTH,
                        num_labels=2)
    return BertForSequenceClassification(config)


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float(np.mean(prediction.predictions.argmax(-1) == prediction.label_ids))}


args = TrainingArguments(
    output_dir=tempfile.gettempdir(), per_device_train_batch_size=32, num_train_epochs=3,
    learning_rate=2e-3, weight_decay=0.01, warmup_steps=0.1, lr_scheduler_type="cosine",
    max_grad_norm=1.0, eval_strategy="epoch", per_device_eval_batch_size=64, seed=0,
    report_to=[], use_cpu=True, save_strategy="no")

job = hf_job(model_init, args, Sentences(1024, 0), eval_dataset=Sentences(256, 1),
             compute_metrics=accuracy)
