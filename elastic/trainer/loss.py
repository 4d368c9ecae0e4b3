"""The two forms a `TrainJob.loss` may return, and what one micro-batch backpropagates.

A scalar is a mean over the samples of the micro-batch; the step scales it by `len/B`, which is
exact only for a per-sample mean. A `LossSum` is a sum over items (tokens that are not padding,
say) and their count; the step backpropagates the sum as is, sums the counts over ranks in the
step's metadata and divides the summed gradients by the global count, so the gradient does not
depend on the shares, the micro-batches or the world size. No torch import here: `elastic`
exports `LossSum` and stays cheap to import.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LossSum:
    """A micro-batch's loss as a sum over items and their count.

    Example: a language model's token loss, split-independent:
    `LossSum(F.cross_entropy(logits, y, ignore_index=PAD, reduction="sum"), (y != PAD).sum())`.

    Attributes:
        total: scalar tensor, the sum of the loss over the items of the micro-batch.
        count: the number of those items (an int or a scalar tensor).
    """

    total: torch.Tensor
    count: int | float | torch.Tensor


class LossForm(IntEnum):
    """Which form a rank's losses took in a step, written into its slot of the metadata."""

    NONE = 0  # no micro-batch (a share of zero, or user code raised before the first loss)
    MEAN = 1  # a scalar: a mean over samples
    SUM = 2  # a `LossSum`


def loss_term(out: Any, scale: float, form: LossForm) -> tuple[Any, Any, LossForm]:
    """What one micro-batch backpropagates, given what `TrainJob.loss` returned.

    Args:
        out: the return value of `TrainJob.loss`.
        scale: `len(micro_batch) / B`, applied to a scalar.
        form: the form of this rank's earlier micro-batches in this step.

    Returns:
        The tensor to backpropagate, the micro-batch's item count (0 for a scalar; a
        `LossSum`'s tensor count on a GPU as `read_later` keeps it, read by the caller with
        the loss, so that it costs no wait for the device here) and its form.

    Raises:
        ValueError: `out` is not of the form of this step's earlier micro-batches, or what it
            backpropagates is not a tensor of one element.
    """
    this = LossForm.SUM if isinstance(out, LossSum) else LossForm.MEAN
    if form not in (LossForm.NONE, this):
        raise ValueError(
            f"TrainJob.loss returned a {_NAMES[this]} after a {_NAMES[form]} in the same step; "
            "return the same form from every micro-batch")
    import torch  # here: this module is imported with `elastic`, which stays cheap to import

    value = out.total if isinstance(out, LossSum) else out
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        what = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                else f"a {type(value).__name__}")
        raise ValueError(
            f"TrainJob.loss returned {what}{' as LossSum.total' if this == LossForm.SUM else ''}; "
            "it must be a tensor of one element: the mean over the micro-batch's samples (for "
            "example reduction='mean'), or LossSum(total, count) with the summed total")
    if isinstance(out, LossSum):
        if isinstance(out.count, torch.Tensor):
            from elastic.trainer.device import read_later

            return out.total, read_later(out.count, "LossSum.count"), this
        return out.total, float(out.count), this
    return out * scale, 0.0, this


_NAMES = {LossForm.MEAN: "scalar", LossForm.SUM: "LossSum"}


def form_error(step: int, forms: tuple[float, ...], count: float, complete: bool) -> str | None:
    """Why the ranks' loss forms cannot make a step, or None when they can.

    Args:
        step: the step.
        forms: every rank's `LossForm` value, in rank order (summed metadata).
        count: the global item count (sum over ranks).
        complete: whether every rank finished its compute (the count is then complete).

    Returns:
        A one-line message naming the fix: the ranks disagree on the form, or the global
        count of a `LossSum` step is 0.
    """
    sums = [rank for rank, f in enumerate(forms) if f == LossForm.SUM]
    means = [rank for rank, f in enumerate(forms) if f == LossForm.MEAN]
    if sums and means:
        return (f"ValueError: TrainJob.loss returned a LossSum on ranks {sums} and a scalar on "
                f"ranks {means} at step {step}; every rank must return the same form in a step")
    if sums and complete and count <= 0:
        return (f"ValueError: TrainJob.loss returned LossSum counts that sum to {count:g} over the "
                f"global batch of step {step}; the count must be positive (the number of items "
                "the total sums over), or return a scalar mean")
    return None
