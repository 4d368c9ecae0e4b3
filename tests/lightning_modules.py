"""Small Lightning modules and data modules for the adapter's tests: a regression MLP with a
step scheduler, clipping, a logged training metric and a `validation_step`, and its data.
Built locally, no downloads."""

from __future__ import annotations

import lightning.pytorch as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

N, N_VAL = 96, 40


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05, hidden: int = 8, scheduler: str = "step") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.lr, self.kind = lr, scheduler

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.log("train_mae", (out - y).abs().mean())
        return {"loss": F.mse_loss(out, y)}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.log("val_loss", F.mse_loss(out, y))
        self.log_dict({"val_mae": (out - y).abs().mean()})

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.kind == "step":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}
        if self.kind == "plateau":
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
            return {"optimizer": optimizer, "lr_scheduler": scheduler, "monitor": "val_loss"}
        return optimizer


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]]) + 0.1 * torch.randn(n, 1, generator=g))
    return TensorDataset(x, y)


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        self.train, self.val = _data(N, 1), _data(N_VAL, 2)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=10)


class ContractBatches(torch.utils.data.Sampler):
    """elastic's public order as a batch sampler for a plain Lightning run: epoch e takes
    `randperm(N, seed + e)` in global batches of `batch`, the rest dropped. Lightning iterates
    it once per epoch (it calls no `set_epoch` on a batch sampler)."""

    def __init__(self, n: int, batch: int, seed: int = 0) -> None:
        self.n, self.batch, self.seed, self.epoch = n, batch, seed, 0
        self.seen: list[list[int]] = []

    def __len__(self) -> int:
        return self.n // self.batch

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
        for s in range(len(self)):
            indices = perm[s * self.batch : (s + 1) * self.batch].tolist()
            self.seen.append(indices)
            yield indices
