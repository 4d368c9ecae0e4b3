"""The public sample order: anyone can replay a run in plain PyTorch.

Epoch e visits `perm_e = torch.randperm(N, generator=torch.Generator().manual_seed(seed + e))`;
global step s of that epoch takes `perm_e[s*B:(s+1)*B]`; the last partial batch is dropped.
The data cursor is just the global step.
"""

from __future__ import annotations

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


class SampleOrder:
    """Indices of global steps, with the current epoch's permutation cached."""

    def __init__(self, dataset_size: int, global_batch_size: int, seed: int) -> None:
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.steps_per_epoch = steps_per_epoch(dataset_size, global_batch_size)
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    def epoch_of(self, global_step: int) -> int:
        return global_step // self.steps_per_epoch

    def global_batch(self, global_step: int) -> torch.Tensor:
        """The B indices of `global_step`."""
        epoch, step = divmod(global_step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._perm = epoch_permutation(self.dataset_size, self.seed, epoch)
            self._epoch = epoch
        b = self.global_batch_size
        return self._perm[step * b : (step + 1) * b]
