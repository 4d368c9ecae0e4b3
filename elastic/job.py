"""`TrainJob`: what to train, as factories that every worker calls for itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic.errors import ConfigError


@dataclass(frozen=True)
class TrainJob:
    """Factories for everything a worker builds. They run on the workers, so they must be
    picklable (closures are fine; Ray uses cloudpickle).

    Args:
        model: `() -> nn.Module`; called under `torch.manual_seed(seed)`.
        optimizer: `(params) -> Optimizer`.
        loss: `(model, batch) -> scalar tensor | elastic.LossSum`. A scalar tensor is a mean
            over the samples of the batch (the step weighs it by the batch's share of the
            global batch, which is exact only for a per-sample mean). A `LossSum(total, count)`
            is the sum of the loss over the batch's items (tokens that are not padding, say)
            and their number; the step divides the summed gradients by the count over the
            global batch, so a token or any masked mean does not depend on how the batch is
            split. Every rank must return the same form within a step.
        dataset: `() -> map-style Dataset` (`len` and integer indexing; `__getitems__` is used
            when there is one), an `elastic.data` sharded source among them, or a
            `ray.data.Dataset` itself (its blocks become the shards of a sharded source that
            the run's controller materialises once; see `elastic.actors.raydata`).
        lr_scheduler: `(optimizer) -> LR scheduler`, stepped once per global step.
        collate_fn: turns a list of samples into a batch; default
            `torch.utils.data.default_collate`.
        evaluate: `(model) -> dict`, run on rank 0 after each epoch and at the end.
        transform: with a Ray Dataset only: `row dict -> sample`, run on the worker.
    """

    model: Callable[[], Any]
    optimizer: Callable[[Any], Any]
    loss: Callable[[Any, Any], Any]
    dataset: Callable[[], Any]
    lr_scheduler: Callable[[Any], Any] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    evaluate: Callable[[Any], dict[str, float]] | None = None
    transform: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.transform is not None and not is_ray_dataset(self.dataset):
            raise ConfigError("TrainJob.transform applies to a Ray Dataset only; a sharded "
                              "source takes its own transform")
        for name in ("model", "optimizer", "loss", "dataset"):
            value = getattr(self, name)
            if name == "dataset" and is_ray_dataset(value):
                continue
            if not callable(value) or _is_module(value):
                raise ConfigError(
                    f"TrainJob.{name} must be a factory (a function), got "
                    f"{type(value).__name__}; wrap it, e.g. {name}=lambda: ..."
                    if name in ("model", "dataset") else
                    f"TrainJob.{name} must be callable, got {type(value).__name__}"
                )
        for name in ("lr_scheduler", "collate_fn", "evaluate", "transform"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"TrainJob.{name} must be callable or None, got {type(value).__name__}")


def is_ray_dataset(value: Any) -> bool:
    """Whether `value` is a `ray.data.Dataset` (checked without importing Ray here)."""
    return any(c.__name__ == "Dataset" and c.__module__.startswith("ray.data")
               for c in type(value).__mro__)


def _is_module(value: Any) -> bool:
    """An nn.Module instance is callable, but a model factory is wanted (checked without
    importing torch here)."""
    return any(c.__name__ == "Module" and c.__module__.startswith("torch.nn") for c in type(value).__mro__)
