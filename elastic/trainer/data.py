"""The public sample order: anyone can replay a run in plain PyTorch.

Epoch e visits `perm_e = torch.randperm(N, generator=torch.Generator().manual_seed(seed + e))`
from the front: a step with global batch B takes the next B indices of it, and when fewer than
B are left the rest of the epoch is dropped and the next epoch begins. With a fixed B, global
step s of epoch e takes `perm_e[s*B:(s+1)*B]`. The data cursor is the position of the next
sample (epoch, offset) together with the step and the samples consumed so far, so that a
batch that follows the world size (`scale_with_workers`) continues exactly where it was.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch


def steps_per_epoch(dataset_size: int, global_batch_size: int) -> int:
    """Full global batches in one epoch.

    Raises:
        ValueError: the data set is smaller than one global batch.
    """
    steps = dataset_size // global_batch_size
    if steps < 1:
        raise ValueError(
            f"the data set has {dataset_size} samples, fewer than one global batch of "
            f"{global_batch_size}; lower batch.global_batch_size"
        )
    return steps


def epoch_permutation(dataset_size: int, seed: int, epoch: int) -> torch.Tensor:
    """The order in which epoch `epoch` visits the data set."""
    return torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed + epoch))


@dataclass(frozen=True)
class Cursor:
    """Where training stands: `step` steps committed, `samples` samples consumed, and the next
    sample is at `offset` of epoch `epoch`'s permutation."""

    step: int = 0
    epoch: int = 0
    offset: int = 0
    samples: int = 0

    def start(self, dataset_size: int, batch: int) -> tuple[int, int]:
        """(epoch, offset) of the next batch of `batch` samples."""
        if self.offset + batch > dataset_size:
            return self.epoch + 1, 0
        return self.epoch, self.offset

    def advance(self, dataset_size: int, batch: int) -> Cursor:
        """The cursor after one more committed step of `batch` samples."""
        epoch, offset = self.start(dataset_size, batch)
        return Cursor(step=self.step + 1, epoch=epoch, offset=offset + batch,
                      samples=self.samples + batch)

    def steps_left_in_epoch(self, dataset_size: int, batch: int) -> int:
        """Steps of `batch` samples until the current epoch (the next batch's) ends."""
        _, offset = self.start(dataset_size, batch)
        return (dataset_size - offset) // batch

    def epochs_done(self, dataset_size: int, batch: int) -> int:
        """Epochs fully consumed, given that the next step has `batch` samples."""
        epoch, _ = self.start(dataset_size, batch)
        return epoch

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, int], dataset_size: int, batch: int) -> Cursor:
        """Reads a cursor; one written before offsets were recorded has only the step (and a
        fixed batch), from which the rest follows."""
        step = int(data["global_step"] if "global_step" in data else data["step"])
        if "offset" in data:
            return cls(step=step, epoch=int(data["epoch"]), offset=int(data["offset"]),
                       samples=int(data.get("samples", step * batch)))
        per_epoch = steps_per_epoch(dataset_size, batch)
        epoch, within = divmod(step, per_epoch)
        if step and within == 0:  # the last epoch ended exactly here
            epoch, within = epoch - 1, per_epoch
        return cls(step=step, epoch=epoch, offset=within * batch, samples=step * batch)


class SampleOrder:
    """The indices of a batch at a cursor.

    A data set that defines `epoch_indices(seed, epoch, start, stop)` (a sharded source:
    `elastic.data.ShardedSource`) defines its own public order; otherwise epoch e visits
    `epoch_permutation(N, seed, e)`, of which the last two epochs' are cached (reading ahead
    crosses into the next epoch while the current one is still being trained on).
    """

    def __init__(self, dataset_size: int, seed: int, source: Any = None) -> None:
        self.dataset_size = dataset_size
        self.seed = seed
        self._source = source if hasattr(source, "epoch_indices") else None
        self._perms: dict[int, torch.Tensor] = {}

    def batch(self, cursor: Cursor, batch: int) -> tuple[int, torch.Tensor]:
        """(epoch, indices) of the next `batch` samples after `cursor`."""
        epoch, offset = cursor.start(self.dataset_size, batch)
        return epoch, self.indices(epoch, offset, offset + batch)

    def indices(self, epoch: int, start: int, stop: int) -> torch.Tensor:
        """Positions `start` to `stop` of epoch `epoch`'s order."""
        if self._source is not None:
            return self._source.epoch_indices(self.seed, epoch, start, stop)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.dataset_size, self.seed, epoch)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1 or e == epoch + 1}
            self._perms[epoch] = perm
        return perm[start:stop]
