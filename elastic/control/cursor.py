"""The data cursor: where training stands in the public sample order (`elastic.trainer.data`
describes the order itself).

The controller commits it at step boundaries and workers advance it, so it lives here, with
no torch: the control plane reads and writes cursors without importing the trainer.

No Ray here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

