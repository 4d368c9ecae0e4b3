"""What a replica does around the forward pass and between the summed gradients and the
update (`FitConfig.training`): autocast, the fp16 loss scale, clipping and the scheduler; and
the job's extra state.

Every rank holds the same `Training` state and applies it to the same summed gradients, so
every decision here (skip and shrink the scale, clip, step the scheduler) is the same on every
rank. The fp16 loss scale follows `torch.amp.GradScaler`'s rule: halve it at a step whose
gradients overflow (the step is skipped on every rank, its samples consumed), double it after
`growth_interval` steps in a row without one.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import math
import traceback
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch

from elastic.config import TrainingConfig
from elastic.errors import AfterStepError, ConfigError

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


class Training:
    """The precision, clipping and scheduler state of one replica.

    Args:
        config: the run's `FitConfig.training`.
        scheduler: the job's learning-rate scheduler, if any.

    Raises:
        ConfigError: a metric-driven scheduler without `training.scheduler_monitor`.
    """

    def __init__(self, config: TrainingConfig, scheduler: Any) -> None:
        self.config = config
        self.scheduler = scheduler
        self.scale = config.init_scale if config.precision == "fp16-mixed" else 1.0
        self.growth_tracker = 0
        self.monitor_sum, self.monitor_steps = 0.0, 0  # the epoch's mean, for 'epoch' + monitor
        self.evaluated_step: int | None = None  # 'evaluation': the step it last stepped after
        # 'epoch': the last epoch whose end the scheduler stepped for (None: a state written
        # before it was recorded; the first end seen sets it).
        self.scheduled_epoch: int | None = -1
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if plateau and config.scheduler_monitor is None:
            raise ConfigError("TrainJob.lr_scheduler is a ReduceLROnPlateau, which steps on a "
                              "metric: set training.scheduler_monitor ('loss' or a metric your "
                              "loss returns)")
        if config.scheduler_monitor is not None and scheduler is None:
            raise ConfigError("training.scheduler_monitor is set but TrainJob.lr_scheduler is "
                              "not; set both or neither")

    # --- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.config.precision, "scale": self.scale,
                "growth_tracker": self.growth_tracker, "monitor_sum": self.monitor_sum,
                "monitor_steps": self.monitor_steps,
                "evaluated_step": -1 if self.evaluated_step is None else self.evaluated_step,
                "scheduled_epoch": self.scheduled_epoch}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Takes a committed state (None: one written before these fields existed)."""
        if not state:
            self.scheduled_epoch = None  # not known: no epoch's end is stepped for unseen
            return
        # A scale saved under another precision (1.0) is no fp16 scale: keep init_scale.
        if self.config.precision == "fp16-mixed" and state.get("precision") == "fp16-mixed":
            self.scale = float(state.get("scale", self.scale))
            self.growth_tracker = int(state.get("growth_tracker", 0))
        self.monitor_sum = float(state.get("monitor_sum", 0.0))
        self.monitor_steps = int(state.get("monitor_steps", 0))
        evaluated = int(state.get("evaluated_step", -1))
        self.evaluated_step = None if evaluated < 0 else evaluated
        scheduled = state.get("scheduled_epoch")
        self.scheduled_epoch = None if scheduled is None else int(scheduled)

    # --- the step ------------------------------------------------------------------------

    def nonfinite_policy(self, policy: Literal["stop", "skip"]) -> Literal["stop", "skip"]:
        """'fp16-mixed' overflows are expected: such a step is always skipped (and the scale
        shrinks); otherwise the run's `failure.nonfinite`."""
        return "skip" if self.config.precision == "fp16-mixed" else policy

    @contextlib.contextmanager
    def autocast(self, model: torch.nn.Module) -> Iterator[None]:
        """Autocast to the mixed precision around forward and loss (nothing at '32')."""
        dtype = _AUTOCAST.get(self.config.precision)
        if dtype is None:
            yield
            return
        device = next((p.device.type for p in model.parameters()), "cpu")
        with torch.autocast(device_type=device, dtype=dtype):
            yield

    def unscale_and_clip(self, params: list[torch.nn.Parameter],
                         norms: list[torch.Tensor] | None = None) -> float | None:
        """Divides the summed gradients by the loss scale, then clips them; returns their
        global 2-norm before clipping when clipping is on (None otherwise). `norms`: every
        parameter's gradient norm before the loss scale is divided out, where this rank holds
        only some of the gradients (sharded gradients): the global norm comes from them."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.scale)  # a power of two: exact
            if norms is not None:
                norms = [n * (1.0 / self.scale) for n in norms]
        config = self.config
        if norms is not None and (config.clip_grad_norm is not None
                                  or config.clip_grad_value is not None):
            total = (torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
                     if norms else torch.zeros(()))
            if config.clip_grad_norm is not None:  # as clip_grad_norm_ scales them
                coefficient = torch.clamp(config.clip_grad_norm / (total + 1e-6), max=1.0)
                if grads:
                    torch._foreach_mul_(grads, coefficient.to(grads[0].device))
            else:
                torch.nn.utils.clip_grad_value_(params, config.clip_grad_value)
            return float(total)
        if config.clip_grad_norm is not None:
            return float(torch.nn.utils.clip_grad_norm_(params, config.clip_grad_norm))
        if config.clip_grad_value is not None:
            norm = (float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0)
            torch.nn.utils.clip_grad_value_(params, config.clip_grad_value)
            return norm
        return None

    def after_step(self, step: int, rank: int, applied: bool, loss: float,
                   metrics: Mapping[str, float], epoch: int, epoch_over: bool) -> None:
        """Updates the loss scale and steps the scheduler once the step is committed (applied,
        or skipped for non-finite values: the step counts, its samples are consumed).

        Raises:
            AfterStepError: the scheduler raised, or `scheduler_monitor` names a metric the
                step does not have (the step stays committed either way).
        """
        if self.config.precision == "fp16-mixed":
            self._update_scale(applied)
        if self.scheduler is None or self.config.scheduler_interval == "evaluation":
            return
        with _as_after_step_error(f"after step {step} was applied", step, rank):
            self._step_scheduler(applied, loss, metrics, epoch, epoch_over)

    def before_step(self, step: int, epoch: int, rank: int) -> None:
        """With `scheduler_interval` 'epoch', before the optimizer step of a committed step of
        `epoch`: steps the scheduler for the end of the epoch before it if no step saw that
        end. With policy 'scale_with_workers' the epoch's end depends on the next step's
        batch: a step judged not the last of its epoch by its own batch can be followed by a
        larger batch (the run grew) that the rest of the epoch cannot fill, so the epoch ends
        unseen. Stepped here, before this step's update, its learning rate is the one it would
        have had had the end been seen.

        Raises:
            AfterStepError: the scheduler raised (before anything of this step was applied;
                every rank raises alike and the run fails).
        """
        if self.scheduler is None or self.config.scheduler_interval != "epoch" \
                or self.scheduled_epoch is None or epoch <= self.scheduled_epoch + 1:
            return
        with _as_after_step_error(f"at the end of epoch {epoch - 1}, stepped before step "
                                  f"{step}", step, rank):
            self._end_epoch(epoch - 1)

    def after_evaluation(self, step: int, rank: int, metrics: Mapping[str, float]) -> None:
        """With `scheduler_interval` 'evaluation': steps the scheduler once after the
        evaluation at committed step `step` (`metrics`: its results, the same on every rank),
        with the `eval/<name>` metric `scheduler_monitor` names. An evaluation run again at the
        same step (after a recovery) does not step it again: the committed state says whether
        it already did.

        Raises:
            AfterStepError: the scheduler raised, or the evaluation has no such metric.
        """
        config = self.config
        if self.scheduler is None or config.scheduler_interval != "evaluation" \
                or self.evaluated_step == step:
            return
        with _as_after_step_error(f"after the evaluation at step {step}", step, rank):
            name = config.scheduler_monitor
            if name is None:
                self.scheduler.step()
            else:
                value = metrics.get(name[len("eval/"):])
                if value is None:
                    raise ConfigError(f"training.scheduler_monitor {name!r} is not a metric "
                                      f"TrainJob.eval_step returns (it returns "
                                      f"{sorted(metrics)})")
                if math.isfinite(value):
                    self.scheduler.step(value)
        self.evaluated_step = step

    def _update_scale(self, applied: bool) -> None:
        if not applied:
            self.scale *= 0.5
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.config.growth_interval:
            self.scale *= 2.0
            self.growth_tracker = 0

    def _end_epoch(self, epoch: int) -> None:
        """Steps the scheduler for the end of `epoch` (with its steps' mean monitored value)."""
        if self.config.scheduler_monitor is None:
            self.scheduler.step()
        elif self.monitor_steps:
            self.scheduler.step(self.monitor_sum / self.monitor_steps)
        self.monitor_sum, self.monitor_steps = 0.0, 0
        self.scheduled_epoch = epoch

    def _step_scheduler(self, applied: bool, loss: float, metrics: Mapping[str, float],
                        epoch: int, epoch_over: bool) -> None:
        config, scheduler = self.config, self.scheduler
        name = config.scheduler_monitor
        value = None
        if name is not None:
            value = loss if name == "loss" else metrics.get(name)
            if value is None and applied:
                raise ConfigError(f"training.scheduler_monitor {name!r} is neither 'loss' nor a "
                                  f"metric TrainJob.loss returns (it returns {sorted(metrics)})")
        if config.scheduler_interval == "epoch":
            if value is not None and math.isfinite(value):
                self.monitor_sum += value
                self.monitor_steps += 1
            # Once per epoch: a step that saw its epoch end can be followed by a smaller
            # batch (the run shrank, policy 'scale_with_workers') that still fits in it.
            if epoch_over and (self.scheduled_epoch is None or self.scheduled_epoch < epoch):
                self._end_epoch(epoch)
        elif name is None:
            scheduler.step()
        elif value is not None and math.isfinite(value):  # a skipped step has no value
            scheduler.step(value)


@contextlib.contextmanager
def _as_after_step_error(when: str, step: int, rank: int) -> Iterator[None]:
    """What the scheduler raises in the block, as the run's `AfterStepError`."""
    try:
        yield
    except ConfigError as e:  # a monitor the run does not have: no traceback to show
        raise AfterStepError(f"{when}: {e}", rank=rank, step=step,
                             traceback=f"ConfigError: {e}") from None
    except Exception:
        raise AfterStepError(f"TrainJob.lr_scheduler raised {when}", rank=rank, step=step,
                             traceback=traceback.format_exc()) from None


def wants_model(factory: Any) -> bool:
    """Whether `TrainJob.optimizer` takes the model (to build parameter groups by name)
    rather than its parameters: its first parameter is named `model` or annotated as a
    `torch.nn.Module`."""
    try:
        first = next(iter(inspect.signature(factory).parameters.values()), None)
    except (TypeError, ValueError):  # a builtin or a class without a signature
        return False
    if first is None:
        return False
    annotation = first.annotation
    if isinstance(annotation, str):
        return first.name == "model" or annotation.rsplit(".", 1)[-1] == "Module"
    return first.name == "model" or (isinstance(annotation, type)
                                     and issubclass(annotation, torch.nn.Module))


def build_extra_state(job: Any, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The job's extra state objects, checked.

    Raises:
        ConfigError: not a mapping of names to objects with state_dict and load_state_dict.
    """
    if job.extra_state is None:
        return {}
    extra = job.extra_state(model, optimizer)
    if not isinstance(extra, Mapping):
        raise ConfigError(f"TrainJob.extra_state returned {type(extra).__name__}; return a dict "
                          "{name: object with state_dict() and load_state_dict()}")
    for name, obj in extra.items():
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(f"TrainJob.extra_state[{name!r}] ({type(obj).__name__}) needs "
                              "state_dict() and load_state_dict()")
        _check_loadable(name, obj)
    return dict(extra)


def _check_loadable(name: str, obj: Any) -> None:
    """Peer restore and checkpoints load the committed state with `torch.load(weights_only=
    True)`, which refuses arbitrary objects: an extra state whose state_dict holds one would
    break the first recovery, so it is refused up front.

    Raises:
        ConfigError: `obj.state_dict()` does not survive a weights-only save and load.
    """
    buffer = io.BytesIO()
    try:
        torch.save(_skeleton(obj.state_dict()), buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"TrainJob.extra_state[{name!r}].state_dict() ({type(obj).__name__}) cannot be "
            f"loaded with torch.load(weights_only=True) ({first}); return tensors, numbers, "
            "strings and lists/dicts of them") from e


def _skeleton(value: Any) -> Any:
    """`value` with every tensor replaced by an empty one of its dtype: what weights-only
    loading accepts or refuses is the same, without copying the tensors' bytes."""
    if isinstance(value, torch.Tensor):
        return torch.empty(0, dtype=value.dtype)
    if isinstance(value, dict):
        out = copy.copy(value)  # the same mapping type, which loading may refuse
        for key, item in value.items():
            out[key] = _skeleton(item)
        return out
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_skeleton(v) for v in value)
    return value


def load_extra_state(extra: Mapping[str, Any], saved: Mapping[str, Any] | None) -> None:
    """Loads each extra state object's committed state.

    Raises:
        ConfigError: the saved state lacks an object's state (it was written by a job with
            other extra state).
    """
    if not extra:
        return
    missing = sorted(set(extra) - set(saved or {}))
    if missing:
        raise ConfigError(f"the committed state has no extra state {missing} (it was written "
                          "by a job with other TrainJob.extra_state)")
    for name, obj in extra.items():
        obj.load_state_dict(saved[name])  # type: ignore[index]


def after_step(extra: Mapping[str, Any], model: torch.nn.Module, step: int, rank: int) -> None:
    """Calls `after_step(model)` of the extra state objects that have one.

    Raises:
        AfterStepError: one raised.
    """
    for name, obj in extra.items():
        hook = getattr(obj, "after_step", None)
        if callable(hook):
            try:
                hook(model)
            except Exception:
                raise AfterStepError(
                    f"TrainJob.extra_state[{name!r}].after_step raised after step {step} was "
                    "applied", rank=rank, step=step, traceback=traceback.format_exc()) from None
