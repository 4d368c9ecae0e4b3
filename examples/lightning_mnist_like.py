"""An unmodified Lightning module and data module, trained elastically: handwritten digits
(the 8x8 images scikit-learn ships), a small CNN, AdamW with weight decay on weights only, a
one-cycle schedule stepped per step, gradient clipping, accuracy logged with `self.log` in
training and validation.

    elastic run examples/lightning_mnist_like.py:job --workers 2 --global-batch 64 --kill-at 10:1

The module and the data module below are plain Lightning; only the last lines are elastic's:
`lightning_job` takes the classes and the arguments you would give `lightning.Trainer`.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

from elastic.integrations.lightning import lightning_job

TOTAL_STEPS = 200  # the one-cycle schedule's length: an upper bound on the run's steps


class DigitsCNN(L.LightningModule):
    def __init__(self, lr: float = 3e-3, weight_decay: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("accuracy", (logits.argmax(1) == y).float().mean())
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_accuracy", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() > 1]
        rest = [p for n, p in self.named_parameters() if p.dim() <= 1]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}], lr=self.hparams.lr)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr,
                                                       total_steps=TOTAL_STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Digits(L.LightningDataModule):
    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        data = load_digits()
        images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
        full = TensorDataset(images, torch.tensor(data.target))
        self.train, self.val = random_split(full, [1497, 300], torch.Generator().manual_seed(0))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=100)


job = lightning_job(DigitsCNN, Digits, gradient_clip_val=1.0, max_epochs=3)
