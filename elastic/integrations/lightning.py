"""A Lightning module and data module, trained elastically: `lightning_job(...)` returns the
`elastic.TrainJob` that does what `lightning.Trainer.fit` would, step for step.

What is taken from the module and how:

- `training_step(batch, batch_idx)` is the loss: a tensor, or a dict with "loss" (a mean over
  the batch's samples, as Lightning assumes). Values passed to `self.log`/`self.log_dict`
  in it become training metrics, each reported per step as its mean over the global batch.
  `batch_idx` is the run's global step (Lightning counts within the epoch); as Lightning, a
  step that does not take it is called without it.
- `configure_optimizers`, in each of its documented forms with one optimizer, gives the
  optimizer and the scheduler with its `interval`, `frequency` and `monitor`. A scheduler
  dict's `interval` "step" steps after every committed step, "epoch" once an epoch's last
  step is committed; a `ReduceLROnPlateau` on "epoch" steps after each evaluation on the
  monitored metric of `validation_step` (as Lightning's does, after the epoch's validation),
  or, on a metric `training_step` logs with on_epoch=True, at the epoch's end on its mean
  over the epoch (Lightning's epoch value); one on "step" steps on the step's value of a
  metric `training_step` logs.
  `frequency` N steps it every N intervals, counted over the run (Lightning counts "step"
  intervals within each epoch: the two agree when an epoch has a multiple of N steps).
- `validation_step(batch, batch_idx)` with `self.log` is the distributed evaluation (when
  there is a `val_dataloader`): every logged value is a mean over its batch (Lightning's
  default), and each metric is reported as its mean over the whole validation set, as
  Lightning's epoch value is. `batch_idx` is 0. Batches are collated with the training
  loader's `collate_fn` (a different one in `val_dataloader` is refused).
- The data module's (or the module's own) `train_dataloader().dataset` and `collate_fn`, and
  `val_dataloader().dataset`, give the data; `prepare_data` (the data module's, then the
  module's, as Lightning) and `setup("fit")` run first in every process that reads data.
  The samples are visited in elastic's public order (a permutation per epoch from the run's
  seed), not in the loader's: its sampler, batch size and workers are not used
  (`FitConfig.batch` and `FitConfig.data` say those). `prepare_data` runs in every such
  process, not once per node as in Lightning.
- `precision`, `gradient_clip_val`, `gradient_clip_algorithm`, `max_epochs`, `max_steps` and
  `check_val_every_n_epoch` mirror `lightning.Trainer`'s arguments, with its defaults; they
  become the job's `settings` (FitConfig fields that `fit` and `elastic run` apply).

Refused at the start, each with what to do instead: manual optimization, more than one
optimizer or scheduler, `accumulate_grad_batches` (the global batch covers it), Trainer
arguments it does not take, clipping with an optimizer over some of the trainable
parameters, `configure_callbacks`, `max_epochs=-1` without `max_steps` (no end), and hooks
whose side effects elastic cannot replay on every rank through failures
(`on_train_batch_end`, `optimizer_step`, `on_validation_epoch_end` and the like). Refused
when they happen: a `training_step` that returns None (Lightning skips the batch; every
rank must do the same for a step), and a torchmetrics `Metric` passed to `self.log` (its
state adds up per rank).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from elastic.errors import ConfigError
from elastic.job import TrainJob
from elastic.trainer.current import current_step

__all__ = ["lightning_job"]

SOURCE = "the Lightning module"

# Hooks that run around Lightning's own loop, with what to do instead. Their side effects
# would run on some ranks, be repeated by a redone step, or be lost with a departed worker.
REFUSED_HOOKS: dict[str, str] = {
    "on_train_batch_start": "move per-step work into training_step",
    "on_train_batch_end": "move per-step work into training_step, or into an elastic.Callback "
                          "(on_step runs in the controller once per committed step)",
    "on_before_backward": "remove it: elastic runs the backward pass",
    "on_after_backward": "remove it: elastic sums the gradients after the backward pass",
    "on_before_optimizer_step": "use gradient_clip_val for clipping, or an elastic.Callback "
                                "for inspection",
    "on_before_zero_grad": "remove it: elastic clears the gradients",
    "optimizer_step": "remove it: elastic applies the summed gradients",
    "optimizer_zero_grad": "remove it: elastic clears the gradients",
    "backward": "remove it: elastic runs the backward pass",
    "configure_gradient_clipping": "use gradient_clip_val and gradient_clip_algorithm",
    "lr_scheduler_step": "return a standard scheduler from configure_optimizers",
    "on_train_epoch_start": "move the work into training_step or an elastic.Callback",
    "on_train_epoch_end": "log epoch metrics from training_step (elastic reports per-step means), "
                          "or use an elastic.Callback",
    "on_validation_epoch_start": "move the work into validation_step",
    "on_validation_epoch_end": "log each value from validation_step with self.log: elastic "
                               "reports its mean over the whole validation set",
    "on_validation_batch_start": "move the work into validation_step",
    "on_validation_batch_end": "move the work into validation_step",
    "training_step_end": "return the loss from training_step",
    "on_fit_start": "do the work in __init__, setup or configure_model",
    "on_train_start": "do the work in __init__, setup or configure_model",
    "on_train_end": "use an elastic.Callback (on_finish)",
    "on_fit_end": "use an elastic.Callback (on_finish)",
    "configure_callbacks": "elastic runs no Lightning callbacks: stop early with "
                           "TrainJob(callbacks=[elastic.EarlyStopping(...)]) (any "
                           "elastic.Callback hook may raise elastic.StopRun), and keep the "
                           "best weights with checkpoint.monitor",
}
_DATA_HOOKS_REFUSED: dict[str, str] = {
    "on_before_batch_transfer": "do it in the dataset or the loader's collate_fn",
    "transfer_batch_to_device": "give TrainJob.move_batch (elastic moves batches itself)",
    "on_after_batch_transfer": "do it in the dataset or the loader's collate_fn",
}
_PRECISION = {"32": "32", "32-true": "32", "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
              "16-mixed": "fp16-mixed", "16": "fp16-mixed"}

# Per process: the data loaders built from a job's data module (`_Lightning.token` -> them).
_LOADERS: dict[str, tuple[Any, Any]] = {}


def lightning_job(module: Any, datamodule: Any = None, *, precision: str | int | None = None,
                  gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None,
                  accumulate_grad_batches: int = 1, max_epochs: int | None = None,
                  max_steps: int = -1, check_val_every_n_epoch: int = 1,
                  datamodule_kwargs: Mapping[str, Any] | None = None,
                  **module_kwargs: Any) -> TrainJob:
    """The `TrainJob` (with its `settings`) that trains a LightningModule elastically.

    Args:
        module: a LightningModule class, or a function that returns a LightningModule; it is
            called with `module_kwargs` on every worker (under the run's seed).
        datamodule: a LightningDataModule class or function (called with
            `datamodule_kwargs`); None: the module's own `train_dataloader`/`val_dataloader`.
        precision, gradient_clip_val, gradient_clip_algorithm, accumulate_grad_batches,
        max_epochs, max_steps, check_val_every_n_epoch: as `lightning.Trainer`'s, with its
            defaults and their meaning (precision None: "32-true"; gradient_clip_algorithm
            None: "norm"; -1: no limit), except that max_epochs None leaves the number of
            epochs to the run's configuration (Lightning's would be 1000 without max_steps).
        datamodule_kwargs: keyword arguments of `datamodule`.
        **module_kwargs: keyword arguments of `module`.

    Raises:
        ConfigError: the module or an argument asks for what elastic cannot do with the same
            meaning (the message says what to do instead).
    """
    _refuse_trainer_arguments(module, module_kwargs)
    spec = _Lightning(module, dict(module_kwargs), datamodule, dict(datamodule_kwargs or {}))
    plan = spec.inspect()
    settings = _settings(precision, gradient_clip_val, gradient_clip_algorithm,
                         accumulate_grad_batches, max_epochs, max_steps,
                         check_val_every_n_epoch, plan)
    return TrainJob(
        model=spec.model, optimizer=spec.optimizer, loss=spec.loss, dataset=spec.dataset,
        collate_fn=spec.collate, lr_scheduler=spec.scheduler if plan.scheduler else None,
        eval_dataset=spec.eval_dataset if plan.validates else None,
        eval_step=spec.eval_step if plan.validates else None,
        settings=settings, source=SOURCE,
    )


def _refuse_trainer_arguments(module: Any, module_kwargs: Mapping[str, Any]) -> None:
    """A `lightning.Trainer` argument that `lightning_job` does not take would go to the
    module (swallowed by a `**kwargs`, or a confusing TypeError on a worker): refused, unless
    the module's constructor names it."""
    import lightning

    trainer = set(inspect.signature(lightning.Trainer.__init__).parameters) - {"self"}
    try:
        named = set(inspect.signature(module).parameters)
    except (TypeError, ValueError):
        named = set()
    stray = sorted(name for name in module_kwargs if name in trainer and name not in named)
    if stray:
        raise ConfigError(
            f"lightning_job: {', '.join(stray)}: lightning.Trainer argument(s) elastic does not "
            "take (they would go to the module). lightning_job takes precision, "
            "gradient_clip_val, gradient_clip_algorithm, accumulate_grad_batches, max_epochs, "
            "max_steps and check_val_every_n_epoch; devices and nodes are the run's workers "
            "(scaling.num_workers); callbacks and loggers are elastic.Callback")


class _Plan:
    """What `configure_optimizers` and the module's hooks say, read once on the driver.
    `partial`: the optimizer takes only some of the module's trainable parameters.
    `on_training`: the monitor of a ReduceLROnPlateau stepped every epoch is a metric of
    `training_step` (logged with on_epoch=True), not of `validation_step`."""

    def __init__(self, scheduler: bool, interval: str, frequency: int, monitor: str | None,
                 plateau: bool, validates: bool, partial: bool = False,
                 on_training: bool = False) -> None:
        self.scheduler, self.interval, self.frequency = scheduler, interval, frequency
        self.monitor, self.plateau, self.validates = monitor, plateau, validates
        self.partial, self.on_training = partial, on_training


def _settings(precision: str | int | None, clip: float | None, algorithm: str | None,
              accumulate: int, max_epochs: int | None, max_steps: int | None, val_every: int,
              plan: _Plan) -> dict[str, Any]:
    """The FitConfig fields the Trainer arguments and the module imply."""
    if accumulate != 1:
        raise ConfigError("accumulate_grad_batches: elastic's global batch already covers "
                          "accumulation: set batch.global_batch_size to the batch size times "
                          f"{accumulate} (times the devices you trained on), and "
                          "batch.max_micro_batch to what fits in a worker's memory")
    settings = {**_precision_settings(precision), **_clip_settings(clip, algorithm, plan),
                **_stop_settings(max_epochs, max_steps)}
    if plan.validates and val_every != 1:  # elastic evaluates every epoch by default
        settings["evaluation.every_epochs"] = val_every
    return {**settings, **_scheduler_settings(plan)}


def _precision_settings(precision: str | int | None) -> dict[str, Any]:
    """Lightning's precision; None is its default, "32-true"."""
    mapped = _PRECISION.get(str("32-true" if precision is None else precision))
    if mapped is None:
        raise ConfigError(f"precision={precision!r}: elastic trains in '32-true', 'bf16-mixed' "
                          f"or '16-mixed' (parameters in float32); choose one of these")
    return {} if mapped == "32" else {"training.precision": mapped}


def _clip_settings(clip: float | None, algorithm: str | None, plan: _Plan) -> dict[str, Any]:
    """Lightning's clipping: none unless `clip` is above 0; `algorithm` in any case, None
    meaning "norm" (`LightningModule.clip_gradients`); checked even without clipping, as
    `lightning.Trainer` checks it."""
    name = "norm" if algorithm is None else str(algorithm).lower()
    if name not in ("norm", "value"):
        raise ConfigError(f"gradient_clip_algorithm={algorithm!r}: use 'norm' or 'value' "
                          "(None: 'norm')")
    if clip is None or clip <= 0:
        return {}
    if plan.partial:
        raise ConfigError(
            "gradient_clip_val: configure_optimizers trains only some of the module's "
            "parameters that require gradients; Lightning clips the optimizer's "
            "parameters, elastic clips every trainable one: freeze the others "
            "(requires_grad=False), which Lightning then leaves alone too")
    return {f"training.clip_grad_{name}": float(clip)}


def _stop_settings(max_epochs: int | None, max_steps: int | None) -> dict[str, Any]:
    """Lightning's limits, -1 turning one off. max_epochs None leaves the epochs to the
    run's configuration (see `lightning_job`)."""
    steps = -1 if max_steps is None else max_steps
    if max_epochs == -1 and steps == -1:
        raise ConfigError("max_epochs=-1 without max_steps: Lightning would train without end, "
                          "and an elastic run needs one: set max_steps, or max_epochs to a "
                          "number of epochs")
    if max_epochs is not None and max_epochs != -1 and max_epochs < 1:
        raise ConfigError(f"max_epochs={max_epochs}: give a number of epochs of at least 1, "
                          "or -1 (no limit) with max_steps")
    if steps != -1 and steps < 1:
        raise ConfigError(f"max_steps={max_steps}: give a number of steps of at least 1, or "
                          "-1 (no limit)")
    settings: dict[str, Any] = {}
    if max_epochs not in (None, -1):
        settings["epochs"] = max_epochs
    if steps != -1:
        settings["max_steps"] = steps
    return settings


def _scheduler_settings(plan: _Plan) -> dict[str, Any]:
    """When the scheduler steps, and on what. A ReduceLROnPlateau stepped every epoch steps
    on its monitor as Lightning reads it then: a validation metric's value after the epoch's
    validation, or a training metric's epoch mean (logged with on_epoch=True)."""
    if not plan.scheduler:
        return {}
    interval, monitor = plan.interval, plan.monitor
    if plan.plateau and interval == "epoch" and not plan.on_training:
        return {"training.scheduler_interval": "evaluation",
                "training.scheduler_monitor": f"eval/{monitor}"}
    settings: dict[str, Any] = {}
    if interval != "step":
        settings["training.scheduler_interval"] = interval
    if plan.plateau:
        settings["training.scheduler_monitor"] = monitor
    return settings


class _Lightning:
    """The factories of a Lightning job; picklable (the classes travel by reference, or by
    value from a script, as cloudpickle sends them)."""

    def __init__(self, module: Any, module_kwargs: dict[str, Any], datamodule: Any,
                 datamodule_kwargs: dict[str, Any]) -> None:
        if not callable(module) or isinstance(module, torch.nn.Module):
            raise ConfigError(f"lightning_job: module must be a LightningModule class or a "
                              f"function that returns one (every worker builds its own), got "
                              f"{type(module).__name__}")
        if datamodule is not None and (not callable(datamodule) or (hasattr(datamodule, "setup")
                                       and not isinstance(datamodule, type))):
            raise ConfigError(f"lightning_job: datamodule must be a LightningDataModule class or "
                              f"a function that returns one, got {type(datamodule).__name__}")
        self.module, self.module_kwargs = module, module_kwargs
        self.datamodule, self.datamodule_kwargs = datamodule, datamodule_kwargs
        self.token = uuid.uuid4().hex
        self.frequency = 1

    # --- read once on the driver -------------------------------------------------------------

    def inspect(self) -> _Plan:
        """Builds the module on the meta device (no memory for its weights; on the CPU if
        its constructor needs real tensors) and reads its hooks and `configure_optimizers`."""
        module = self._build_light(configure=True)
        _refuse_hooks(module)
        try:
            with torch.device(_device_of(module)):
                conf = module.configure_optimizers()
        except RuntimeError as e:
            if "not attached to a `Trainer`" in str(e):
                raise ConfigError("configure_optimizers reads self.trainer, but elastic runs the "
                                  "module without a Lightning Trainer: pass what it needs "
                                  "(the number of steps, say) as an argument of the module") from e
            raise
        optimizer, scheduler = _parse_optimizers(conf)
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        partial = any(id(p) not in trained for p in module.parameters() if p.requires_grad)
        del optimizer
        if scheduler is None:
            return _Plan(False, "step", 1, None, False, self._validates(module), partial)
        self.frequency = int(scheduler.get("frequency", 1))
        if self.frequency < 1:
            raise ConfigError(f"configure_optimizers: scheduler frequency {self.frequency} "
                              "must be at least 1")
        plateau = bool(scheduler.get("reduce_on_plateau", isinstance(
            scheduler["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau)))
        interval = scheduler.get("interval", "epoch")
        if interval not in ("step", "epoch"):
            raise ConfigError(f"configure_optimizers: scheduler interval {interval!r} must be "
                              "'step' or 'epoch'")
        monitor = scheduler.get("monitor")
        if plateau and not monitor:
            raise ConfigError("configure_optimizers: a ReduceLROnPlateau needs a monitor: "
                              "return {'optimizer': ..., 'lr_scheduler': ..., 'monitor': name}")
        validates = self._validates(module)
        on_training = plateau and interval == "epoch" and _monitors_training(
            module, monitor, validates)
        return _Plan(True, interval, self.frequency, monitor, plateau, validates, partial,
                     on_training)

    def _build_light(self, configure: bool = False) -> Any:
        """The module on the meta device, or on the CPU if its constructor (or
        `configure_model`) needs real tensors."""
        for device in ("meta", "cpu"):
            try:
                with torch.device(device):
                    module = self._build()
                    if configure:
                        module.configure_model()
                return module
            except ConfigError:
                raise
            except Exception:
                if device == "cpu":
                    raise
        raise AssertionError("unreachable")

    def _validates(self, module: Any) -> bool:
        """Whether there is a validation to run: a `validation_step` and a `val_dataloader`
        (Lightning skips validation without one)."""
        if not _overrides(module, "validation_step"):
            return False
        if self.datamodule is None:
            return _overrides(module, "val_dataloader")
        cls = self.datamodule if isinstance(self.datamodule, type) else None
        if cls is None:  # a function: what it builds is seen only when it runs
            return True
        return getattr(cls, "val_dataloader", None) is not getattr(
            _lightning_base_class(cls, "LightningDataModule"), "val_dataloader", None)

    # --- the factories, called on the workers -------------------------------------------------

    def _build(self) -> Any:
        module = self.module(**self.module_kwargs)
        if _lightning_base(module, "LightningModule") is None:
            raise ConfigError(f"lightning_job: module built a {type(module).__name__}, not a "
                              "LightningModule")
        return module

    def model(self) -> Any:
        module = self._build()
        _refuse_hooks(module)
        module.setup("fit")
        module.configure_model()
        _capture_logs(module)
        return module

    def optimizer(self, model: Any) -> torch.optim.Optimizer:
        optimizer, scheduler = _parse_optimizers(model.configure_optimizers())
        if scheduler is not None:
            _SCHEDULERS[id(optimizer)] = scheduler["scheduler"]
        return optimizer

    def scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        scheduler = _SCHEDULERS.pop(id(optimizer), None)
        if scheduler is None:
            raise ConfigError("configure_optimizers returned no scheduler on this worker, but "
                              "it did on the driver: it must return the same every time")
        return scheduler if self.frequency == 1 else EveryN(scheduler, self.frequency)

    def loss(self, model: Any, batch: Any) -> Any:
        logged = model._elastic_logged
        logged.clear()
        step = current_step()
        out = model.training_step(*_step_args(model.training_step, batch,
                                              0 if step is None else step))
        if out is None:
            raise ConfigError(
                "training_step returned None, with which Lightning skips the batch: elastic "
                "cannot, as every rank must do the same for a step and each holds only part "
                "of its batch; return a loss for every batch (leave out of the data set the "
                "samples you would skip)")
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ConfigError("training_step must return the loss: a tensor or a dict with "
                              f"'loss' (returned {type(out).__name__})")
        metrics = {name: value for name, (value, _) in logged.items()}
        return (loss, metrics) if metrics else loss

    def eval_step(self, model: Any, batch: Any) -> dict[str, tuple[Any, float]]:
        logged = model._elastic_logged
        logged.clear()
        model.validation_step(*_step_args(model.validation_step, batch, 0))
        size = None
        terms = {}
        for name, (value, batch_size) in logged.items():
            if batch_size is None:
                size = size if size is not None else _batch_length(batch)
                batch_size = size
            terms[name] = (value.detach().double() * batch_size if isinstance(value, torch.Tensor)
                           else float(value) * batch_size, float(batch_size))
        return terms

    def dataset(self) -> Any:
        train, _ = self._loaders()
        if isinstance(train.dataset, torch.utils.data.IterableDataset):
            raise ConfigError("train_dataloader's dataset is an IterableDataset: elastic needs a "
                              "map-style dataset (len and indexing) to split and replay the "
                              "order, or an elastic.data sharded source")
        return train.dataset

    def collate(self, samples: list[Any]) -> Any:
        train, _ = self._loaders()
        collate = train.collate_fn or torch.utils.data.default_collate
        return collate(samples)

    def eval_dataset(self) -> Any:
        _, val = self._loaders()
        if val is None:
            raise ConfigError("the module has a validation_step but no val_dataloader: give "
                              "one in the data module")
        return val.dataset

    def _loaders(self) -> tuple[Any, Any]:
        """The train and validation loaders, built once per process."""
        built = _LOADERS.get(self.token)
        if built is None:
            if self.datamodule is not None:
                source = self.datamodule(**self.datamodule_kwargs)
                _refuse_data_hooks(source)
                source.prepare_data()
                self._prepare_module_data()  # after the data module's, as Lightning
            else:
                source = self._build_light()
                source.prepare_data()
            source.setup("fit")
            train = source.train_dataloader()
            val = source.val_dataloader() if _overrides(source, "val_dataloader") else None
            if isinstance(val, (list, tuple)):
                if len(val) != 1:
                    raise ConfigError("val_dataloader returned several loaders: elastic "
                                      "evaluates one validation set")
                val = val[0]
            if val is not None and not _same_collate(_collate_of(val), _collate_of(train)):
                raise ConfigError("val_dataloader's collate_fn differs from train_dataloader's: "
                                  "elastic evaluates with the training collate_fn; give both "
                                  "loaders the same one")
            built = _LOADERS[self.token] = (train, val)
        return built

    def _prepare_module_data(self) -> None:
        """The module's own `prepare_data`, which Lightning runs after the data module's
        (`DataConnector.prepare_data`); the module is built for it only if it has one."""
        cls = self.module if isinstance(self.module, type) else None
        if cls is not None and getattr(cls, "prepare_data", None) is getattr(
                _lightning_base_class(cls, "LightningModule"), "prepare_data", None):
            return
        self._build_light().prepare_data()


# The scheduler `optimizer` built, until `scheduler` takes it (the two run back to back).
_SCHEDULERS: dict[int, Any] = {}


class EveryN:
    """A scheduler stepped every `n`-th time its `step` is called (Lightning's `frequency`);
    the count is part of its state."""

    def __init__(self, scheduler: Any, n: int) -> None:
        self.scheduler, self.n, self.calls = scheduler, n, 0
        self.optimizer = scheduler.optimizer

    def step(self, *args: Any) -> None:
        self.calls += 1
        if self.calls % self.n == 0:
            self.scheduler.step(*args)

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "calls": self.calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.calls = int(state["calls"])

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()


def _parse_optimizers(conf: Any) -> tuple[torch.optim.Optimizer, dict[str, Any] | None]:
    """The optimizer and the scheduler config (a dict with "scheduler" and Lightning's keys)
    of what `configure_optimizers` returned, in each of its documented forms.

    Raises:
        ConfigError: no optimizer, several, or several schedulers.
    """
    several = ("configure_optimizers returned {}: elastic trains with one optimizer and at "
               "most one scheduler (for parameter groups with their own settings, use one "
               "optimizer with several param_groups)")
    optimizers: list[Any]
    schedulers: list[Any] = []
    monitor = None
    if isinstance(conf, torch.optim.Optimizer):
        optimizers = [conf]
    elif isinstance(conf, Mapping):
        optimizers = [conf.get("optimizer")]
        monitor = conf.get("monitor")
        if conf.get("lr_scheduler") is not None:
            schedulers = [conf["lr_scheduler"]]
    elif isinstance(conf, (list, tuple)) and len(conf) == 2 and isinstance(conf[0], (list, tuple)):
        optimizers = list(conf[0])
        schedulers = list(conf[1]) if isinstance(conf[1], (list, tuple)) else [conf[1]]
    elif isinstance(conf, (list, tuple)) and conf and all(isinstance(d, Mapping) for d in conf):
        if len(conf) != 1:
            raise ConfigError(several.format(f"{len(conf)} optimizer dicts"))
        return _parse_optimizers(conf[0])
    elif isinstance(conf, (list, tuple)):
        optimizers = list(conf)
    else:
        raise ConfigError(f"configure_optimizers returned {type(conf).__name__}: return an "
                          "optimizer, a list of one, ([optimizer], [scheduler]) or a dict "
                          "with 'optimizer' (None: elastic cannot train without one)")
    if len(optimizers) != 1:
        raise ConfigError(several.format(f"{len(optimizers)} optimizers"))
    if not isinstance(optimizers[0], torch.optim.Optimizer):
        raise ConfigError(f"configure_optimizers returned {type(optimizers[0]).__name__} as "
                          "the optimizer, not a torch.optim.Optimizer")
    if len(schedulers) > 1:
        raise ConfigError(several.format(f"{len(schedulers)} schedulers"))
    if not schedulers:
        return optimizers[0], None
    scheduler = schedulers[0]
    config = dict(scheduler) if isinstance(scheduler, Mapping) else {"scheduler": scheduler}
    if "scheduler" not in config:
        raise ConfigError("configure_optimizers: a scheduler dict needs the key 'scheduler'")
    if monitor is not None:
        config.setdefault("monitor", monitor)
    if isinstance(config["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau):
        config.setdefault("interval", "epoch")
    return optimizers[0], config


def _collate_of(loader: Any) -> Any:
    return loader.collate_fn or torch.utils.data.default_collate


def _same_collate(a: Any, b: Any) -> bool:
    """Whether two loaders' collate functions do the same: the same object, equal ones (a
    bound method of one data module, read twice; a collator dataclass of the same fields), or
    partials of one function with equal arguments."""
    if a is b:
        return True
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return (_same_collate(a.func, b.func) and _equal(a.args, b.args)
                and _equal(a.keywords, b.keywords))
    return _equal(a, b)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an __eq__ that cannot answer (arrays, say): not the same
        return False


def _device_of(module: Any) -> str:
    return next((p.device.type for p in module.parameters()), "cpu")


def _lightning_base_class(cls: type, name: str) -> type | None:
    for base in cls.__mro__:
        if base.__name__ == name and base.__module__.split(".")[0] in ("lightning", "pytorch_lightning"):
            return base
    return None


def _lightning_base(obj: Any, name: str) -> type | None:
    """Lightning's class `name` (LightningModule or LightningDataModule) among `obj`'s bases,
    from `lightning.pytorch` or `pytorch_lightning` alike (found without importing either)."""
    return _lightning_base_class(type(obj), name)


def _overrides(obj: Any, name: str) -> bool:
    """Whether `obj`'s class defines `name` itself rather than inheriting Lightning's."""
    base = _lightning_base(obj, "LightningDataModule") or _lightning_base(obj, "LightningModule")
    mine = getattr(type(obj), name, None)
    return mine is not None and mine is not getattr(base, name, None)


def _refuse_hooks(module: Any) -> None:
    if not module.automatic_optimization:
        raise ConfigError("the module sets automatic_optimization = False: elastic applies the "
                          "summed gradients itself; return the loss from training_step and let "
                          "configure_optimizers give the optimizer")
    _refuse(module, {**REFUSED_HOOKS, **_DATA_HOOKS_REFUSED}, "LightningModule")


def _refuse_data_hooks(datamodule: Any) -> None:
    _refuse(datamodule, _DATA_HOOKS_REFUSED, "LightningDataModule")


def _refuse(obj: Any, hooks: Mapping[str, str], kind: str) -> None:
    found = [name for name in hooks if _overrides(obj, name)]
    if found:
        name = found[0]
        raise ConfigError(f"{type(obj).__name__}.{name}: elastic does not run {kind} hook "
                          f"{name} (its effects would not be the same on every rank through "
                          f"failures): {hooks[name]}")


def _step_args(hook: Any, batch: Any, batch_idx: int) -> tuple[Any, ...]:
    """The arguments of `training_step` or `validation_step`, as Lightning passes them:
    `batch_idx` only when the hook takes it (`is_param_in_hook_signature`)."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    if is_param_in_hook_signature(hook, "batch_idx", min_args=2):
        return batch, batch_idx
    return (batch,)


def _monitors_training(module: Any, monitor: str, validates: bool) -> bool:
    """Whether a ReduceLROnPlateau stepped every epoch monitors a metric of `training_step`
    (Lightning steps it on the epoch mean when it is logged with on_epoch=True, on the last
    step's value otherwise) rather than one of `validation_step` (its value after the
    epoch's validation). Told from the names the two steps log, written out.

    Raises:
        ConfigError: the name is logged by both, by `training_step` without on_epoch=True,
            or not by `training_step` in a module with nothing to validate.
    """
    train = _logged_names(module, "training_step")
    val = _logged_names(module, "validation_step")
    plateau = f"configure_optimizers: the ReduceLROnPlateau monitors {monitor!r}"
    if monitor in train and monitor in val:
        raise ConfigError(f"{plateau}, which both training_step and validation_step log: "
                          "log the two under different names and monitor one")
    if monitor in train:
        if not train[monitor]:
            raise ConfigError(
                f"{plateau}, which training_step logs without on_epoch=True: Lightning would "
                "step it every epoch on the last step's value, which elastic does not keep; "
                f"log it with self.log({monitor!r}, ..., on_epoch=True) to step it on the "
                "epoch's mean, or step it every step ('interval': 'step')")
        return True
    if validates:
        # Logged by validation_step, or under a name not written out there (computed, or
        # through a helper): taken for a validation metric, the usual plateau's; a run
        # whose evaluation does not return it fails at its first, naming it.
        return False
    raise ConfigError(f"{plateau}, which training_step does not log with that name written "
                      "out, and there is no val_dataloader to validate on: log it in "
                      f"training_step with self.log({monitor!r}, ..., on_epoch=True), or give "
                      "a val_dataloader")


def _logged_names(module: Any, hook: str) -> dict[str, bool]:
    """The names `module`'s `hook` logs with `self.log` or `self.log_dict`, written out as
    strings in its source, each with whether every such call passes on_epoch=True written
    out. A name the hook computes, or logs through another method, is not seen."""
    base = _lightning_base(module, "LightningModule")
    fn = getattr(type(module), hook, None)
    if base is None or fn is None or fn is getattr(base, hook, None):
        return {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return {}
    found: dict[str, bool] = {}
    for method, args in _log_calls(tree, base):
        dictionary = args.get("dictionary")
        names = [args.get("name")] if method == "log" else (  # a dict display's key expressions
            dictionary.keys if isinstance(dictionary, ast.Dict) else [])
        epoch = args.get("on_epoch")
        on_epoch = isinstance(epoch, ast.Constant) and epoch.value is True
        for name in names:
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                found[name.value] = found.get(name.value, True) and on_epoch
    return found


def _log_calls(tree: ast.AST, base: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each `self.log(...)` and `self.log_dict(...)` call in `tree`: the method and its
    arguments' expressions by parameter name, bound as Lightning's own signature binds them
    (a call that does not bind is left out; one with `**kwargs` is seen without them)."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                and node.func.attr in ("log", "log_dict")):
            continue
        try:
            bound = inspect.signature(getattr(base, node.func.attr)).bind(
                None, *node.args, **{k.arg: k.value for k in node.keywords if k.arg})
        except TypeError:
            continue
        yield node.func.attr, bound.arguments


def _capture_logs(module: Any) -> None:
    """Replaces the module's `log` and `log_dict` by ones that keep the values for the step
    (or the evaluation batch) being run: `module._elastic_logged`, name -> (value, batch_size)."""
    logged: dict[str, tuple[Any, int | None]] = {}

    def log(name: str, value: Any, *args: Any, batch_size: int | None = None,
            reduce_fx: Any = "mean", **kwargs: Any) -> None:
        if reduce_fx not in ("mean", torch.mean):
            raise ValueError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): elastic reports "
                             "each metric as its mean over the batch; log a mean")
        if _is_torchmetrics(value):
            raise ConfigError(
                f"self.log({name!r}, {type(value).__name__}): elastic does not log torchmetrics "
                "Metric objects (their state adds up in each rank, which elastic cannot keep "
                "the same on every rank through failures); log the value the metric returns "
                f"for the batch, self.log({name!r}, metric(preds, target)): elastic reports its "
                "mean, which is the metric's own value for metrics that are means over "
                "samples (accuracy)")
        if isinstance(value, Mapping) or not _is_scalar(value):
            raise ValueError(f"self.log({name!r}, ...) got {type(value).__name__}: elastic "
                             "takes a number or a one-element tensor")
        logged[name] = (value, batch_size)

    def log_dict(dictionary: Mapping[str, Any], *args: Any, batch_size: int | None = None,
                 reduce_fx: Any = "mean", **kwargs: Any) -> None:
        for name, value in dictionary.items():
            log(name, value, batch_size=batch_size, reduce_fx=reduce_fx)

    object.__setattr__(module, "_elastic_logged", logged)
    object.__setattr__(module, "log", log)
    object.__setattr__(module, "log_dict", log_dict)


def _is_torchmetrics(value: Any) -> bool:
    """Whether `value` is a torchmetrics `Metric` (or a collection of them), found without
    importing torchmetrics."""
    return any(cls.__module__.split(".")[0] == "torchmetrics" for cls in type(value).__mro__)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _batch_length(batch: Any) -> int:
    """Lightning's inferred batch size: the first dimension of the first tensor found."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        items: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        raise ValueError(f"cannot infer the batch size of a {type(batch).__name__}: pass "
                         "batch_size= to self.log in validation_step")
    for item in items:
        try:
            return _batch_length(item)
        except ValueError:
            continue
    raise ValueError("cannot infer the batch size: pass batch_size= to self.log in "
                     "validation_step")

