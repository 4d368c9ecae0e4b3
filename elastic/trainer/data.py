"""The public sample order: anyone can replay a run in plain PyTorch.

Epoch e visits `perm_e = torch.randperm(N, generator=torch.Generator().manual_seed(seed + e))`
from the front: a step with global batch B takes the next B indices of it, and when fewer than
B are left the rest of the epoch is dropped and the next epoch begins. With a fixed B, global
step s of epoch e takes `perm_e[s*B:(s+1)*B]`. The data cursor (`Cursor`, which lives in
`elastic.control.cursor`, without torch, and is re-exported here) is the position of the next
sample (epoch, offset) together with the step and the samples consumed so far, so that a
batch that follows the world size (`scale_with_workers`) continues exactly where it was.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic.control.cursor import Cursor, steps_per_epoch

__all__ = ["Cursor", "SampleOrder", "epoch_permutation", "steps_per_epoch"]


def epoch_permutation(dataset_size: int, seed: int, epoch: int) -> torch.Tensor:
    """The order in which epoch `epoch` visits the data set."""
    return torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed + epoch))


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
