"""`TrainJob`: what to train, as factories that every worker calls for itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic.errors import ConfigError

# What a callback may define (`elastic.callbacks.Callback` documents each).
CALLBACK_HOOKS = ("on_step", "on_event", "on_evaluate", "on_checkpoint", "on_finish")


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
        evaluate: `(model) -> dict`, run on rank 0 after each epoch and at the end (the
            simple form; `eval_dataset` with `eval_step` is the distributed one). The model is
            on the worker's device (a GPU with `scaling.use_gpu`): move its inputs there.
        transform: with a Ray Dataset only: `row dict -> sample`, run on the worker.
        eval_dataset: `() -> map-style Dataset` evaluated with `eval_step`, split over the
            current members (`FitConfig.evaluation` says when).
        eval_step: `(model, batch) -> {name: (sum, count)}`: per metric, the sum over the
            batch's items and their number (tensors or numbers; `elastic.LossSum` works too);
            each metric is reported as its sums over the whole evaluation set divided by its
            counts. Runs under `torch.no_grad()` with the model in eval mode, on batches moved
            to the worker's device as the training batches are (`move_batch`).
        callbacks: `elastic.Callback` objects; they run in the controller process, never in a
            worker's step (see `elastic.callbacks`).
        extra_state: `(model, optimizer) -> {name: object}`: state beside the model and the
            optimizer (an EMA of the weights, user counters), each object with `state_dict()`
            and `load_state_dict(d)`; part of peer restore and checkpoints. An object with an
            `after_step(model)` method has it called on every rank after each applied
            optimizer step. Tensors of a loaded state (which is read into host memory) are
            moved to where the object keeps them, or to the worker's device.
        move_batch: `(batch, device) -> batch`: puts a batch (as `collate_fn` made it) on the
            worker's device (`torch.device('cuda', i)` with `scaling.use_gpu`, else the CPU)
            before `loss` sees it. Default: every tensor in it, through dicts, lists, tuples,
            named tuples and dataclasses, copied with `non_blocking=True` (asynchronous from
            the pinned memory of `data.pin_memory`); on a CPU worker the batch is passed through
            untouched. Give one for a batch type that holds tensors elsewhere, or to move only
            part of a batch; a given one is called on CPU workers too.
        settings: FitConfig fields the job implies, as dotted names -> values (a framework
            adapter's: `{"training.precision": "bf16-mixed"}` from a Lightning `precision`).
            `fit`, `start`, `resume` and `elastic run` apply each that the run's configuration
            leaves unset, and refuse a configuration that sets one to another value.
        source: what built the job, for messages about its settings.
    """

    model: Callable[[], Any]
    optimizer: Callable[[Any], Any]
    loss: Callable[[Any, Any], Any]
    dataset: Callable[[], Any]
    lr_scheduler: Callable[[Any], Any] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    evaluate: Callable[[Any], dict[str, float]] | None = None
    transform: Callable[[Any], Any] | None = None
    eval_dataset: Callable[[], Any] | None = None
    eval_step: Callable[[Any, Any], Any] | None = None
    callbacks: tuple[Any, ...] = ()
    extra_state: Callable[[Any, Any], Any] | None = None
    move_batch: Callable[[Any, Any], Any] | None = None
    settings: Mapping[str, Any] = field(default_factory=dict, hash=False)
    source: str = "the job"

    def __post_init__(self) -> None:
        if not isinstance(self.settings, Mapping) or not all(isinstance(k, str) for k in self.settings):
            raise ConfigError("TrainJob.settings must map dotted FitConfig field names to values")
        object.__setattr__(self, "settings", dict(self.settings))
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
        if (self.eval_dataset is None) != (self.eval_step is None):
            raise ConfigError("TrainJob.eval_dataset and TrainJob.eval_step go together: set both "
                              "(or neither)")
        object.__setattr__(self, "callbacks", tuple(self.callbacks))
        for callback in self.callbacks:
            if not any(hasattr(callback, hook) for hook in CALLBACK_HOOKS):
                raise ConfigError(f"TrainJob.callbacks: {type(callback).__name__} has none of the "
                                  f"hooks {', '.join(CALLBACK_HOOKS)}")
        for name in ("lr_scheduler", "collate_fn", "evaluate", "transform", "eval_dataset",
                     "eval_step", "extra_state", "move_batch"):
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
