"""`TrainJob`: what to train, as factories that every worker calls for itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainJob:
    """Factories for everything a worker builds. They run on the workers, so they must be
    picklable (closures are fine; Ray uses cloudpickle).

    Args:
        model: `() -> nn.Module`; called under `torch.manual_seed(seed)`.
        optimizer: `(params) -> Optimizer`.
        loss: `(model, batch) -> scalar tensor`, the mean loss of that batch.
        dataset: `() -> map-style Dataset` (`len` and integer indexing).
        lr_scheduler: `(optimizer) -> LR scheduler`, stepped once per global step.
        collate_fn: turns a list of samples into a batch; default
            `torch.utils.data.default_collate`.
        evaluate: `(model) -> dict`, run on rank 0 after each epoch and at the end.
    """

    model: Callable[[], Any]
    optimizer: Callable[[Any], Any]
    loss: Callable[[Any, Any], Any]
    dataset: Callable[[], Any]
    lr_scheduler: Callable[[Any], Any] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    evaluate: Callable[[Any], dict[str, float]] | None = None
