"""A Hugging Face `Trainer` setup, trained elastically: `hf_job(model_init, args,
train_dataset, ...)` returns the `elastic.TrainJob` that does what `transformers.Trainer` would
with the same arguments, step for step.

What is taken from where:

- The optimizer is `Trainer`'s: its decay groups (weight decay on every parameter but biases
  and norm weights, `Trainer.get_decay_parameter_names`) and the class and arguments that
  `args.optim` names (`Trainer.get_optimizer_cls_and_kwargs`).
- The scheduler is `transformers.get_scheduler(args.lr_scheduler_type, ...)` with
  `args.get_warmup_steps(n)` over the run's n optimizer steps, as `Trainer.create_scheduler`.
- The global batch is `per_device_train_batch_size * gradient_accumulation_steps` (the
  batch one `Trainer` process takes per optimizer step); `per_device_train_batch_size` is the
  largest micro-batch (`batch.max_micro_batch`). The world size then changes nothing.
- The loss: a model whose loss takes `num_items_in_batch` (its forward hands it to
  `self.loss_function`: causal and masked language models) is trained on
  `LossSum(total, count)`: the summed token loss and the number of tokens that count (labels
  that are not -100, shifted for a causal LM), which is what `Trainer` divides by across its
  accumulated batches; the result does not depend on how the batch is split. A model that
  computes its own mean, or whose batches have no "labels" (`Trainer` counts items only in
  batches with "labels": question answering, custom `label_names`): with gradient
  accumulation, each accumulated batch of `per_device_train_batch_size` samples is one group
  (`batch.groups`), run in one forward and weighted alike, as `Trainer` averages them
  (per-sample heads need no groups); without,
  a mean over tokens (labels with one class per token: BERT's masked LM, T5, token
  classification, causal LMs that take no loss keyword arguments) is trained as the
  cross-entropy summed over the tokens that count, shifted or not as the model's own loss
  says (read once), and any other loss as a per-sample mean, with a warning.
- `max_grad_norm` (clipping), `bf16`/`fp16`, `seed`, `num_train_epochs`/`max_steps`,
  `eval_strategy`/`eval_steps`, `per_device_eval_batch_size` become the job's `settings`.
- The model is built as `Trainer.train` prepares it: `activation_checkpointing` (alias
  `gradient_checkpointing`) turned on with its keyword arguments, and a tokenizer's special
  tokens (`processing_class`) set in its config.
- Evaluation (with `eval_dataset` and an `eval_strategy` other than "no"): the model's loss
  on each batch weighted by its number of samples ("loss", as `Trainer`'s eval_loss), and
  `compute_metrics` called on each batch's `EvalPrediction`, each value weighted by the
  batch's samples: exact for metrics that are means over samples (accuracy), not for others
  (F1, AUC), which need the whole set at once.
- The data: `train_dataset` and `eval_dataset` travel to the workers with the job, pickled
  with it (a data set that holds files by path needs them on every node); columns the
  model's `forward` does not take are dropped (`remove_unused_columns`); `data_collator`
  makes the batches (default as `Trainer`'s: `DataCollatorWithPadding` with a tokenizer as
  `processing_class`, `transformers.default_data_collator` otherwise). The order is
  elastic's public one.

Refused, each with what to do instead: DeepSpeed, FSDP, `torch_compile`, label smoothing,
`group_by_length`, optimizers outside torch's, `batch_eval_metrics`, fractional epochs,
schedulers stepped on a metric, `load_best_model_at_end`, NEFTune, Liger kernels
(`use_liger_kernel`), activation checkpointing on a model that cannot do it, and gradient
accumulation with a model that `Trainer` passes `num_items_in_batch` (its forward takes loss
keyword arguments, its batches have "labels") but whose loss is a per-batch mean, which
`Trainer` would not divide by the accumulation steps.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from elastic.errors import ConfigError
from elastic.job import TrainJob
from elastic.trainer.loss import LossSum

__all__ = ["hf_job"]

SOURCE = "the Hugging Face TrainingArguments"

# `args.optim` values whose optimizer is torch's own (or transformers' Adafactor).
SUPPORTED_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad",
                        "rmsprop")
_TOKEN_LOSSES = ("ForCausalLMLoss", "ForMaskedLMLoss", "ForTokenClassification")
# transformers heads whose loss is a mean over samples (one label, or one span, per sample).
_PER_SAMPLE_HEADS = ("ForSequenceClassification", "ForImageClassification",
                     "ForAudioClassification", "ForMultipleChoice", "ForQuestionAnswering")


def hf_job(model_init: Callable[[], Any], args: Any, train_dataset: Any, eval_dataset: Any = None,
           data_collator: Callable[[list[Any]], Any] | None = None,
           compute_metrics: Callable[[Any], Mapping[str, float]] | None = None,
           processing_class: Any = None) -> TrainJob:
    """The `TrainJob` (with its `settings`) that trains as `transformers.Trainer(model_init=
    model_init, args=args, ...)` would.

    Args:
        model_init: `() -> PreTrainedModel`, called on every worker under `args.seed`.
        args: the `transformers.TrainingArguments`.
        train_dataset: a map-style dataset (a `datasets.Dataset`, a torch Dataset).
        eval_dataset: the evaluation set, evaluated as `args.eval_strategy` says.
        data_collator: list of samples -> batch; default as `Trainer`'s:
            `DataCollatorWithPadding(processing_class)` with a tokenizer (or a sequence
            feature extractor), `transformers.default_data_collator` otherwise.
        compute_metrics: `EvalPrediction -> {name: value}`, called per evaluation batch.
        processing_class: `Trainer`'s: the tokenizer, feature extractor or processor; it
            travels with the job. It chooses the default collator, and a tokenizer's (or a
            processor's) special tokens are set in the model's config, as `Trainer.train`.

    Raises:
        ConfigError: an argument asks for what elastic cannot do with the same meaning.
    """
    _refuse(args)
    if eval_dataset is None and _strategy(args.eval_strategy) != "no":
        raise ConfigError(f"TrainingArguments.eval_strategy={_strategy(args.eval_strategy)!r} "
                          "but no eval_dataset: pass one, or set eval_strategy='no' (Trainer "
                          "refuses this too)")
    spec = _HuggingFace(model_init, args, train_dataset, eval_dataset, data_collator,
                        compute_metrics, processing_class)
    settings = spec.inspect()
    evaluates = eval_dataset is not None and _strategy(args.eval_strategy) != "no"
    return TrainJob(
        model=spec.model, optimizer=spec.optimizer, loss=spec.loss, dataset=spec.dataset,
        collate_fn=spec.collate, lr_scheduler=spec.scheduler,
        eval_dataset=spec.eval_data if evaluates else None,
        eval_step=spec.eval_step if evaluates else None,
        settings=settings, source=SOURCE,
    )


def _strategy(value: Any) -> str:
    return str(getattr(value, "value", value))


def _refuse(args: Any) -> None:
    def arg(name: str, default: Any = None) -> Any:  # fields differ between versions
        return getattr(args, name, default)

    checks = [
        (bool(arg("deepspeed")), "deepspeed", "elastic shards optimizer state itself: "
         "FitConfig(sharding=elastic.ShardingConfig(stage=1))"),
        (bool(arg("fsdp")), "fsdp", "elastic is data-parallel; for optimizer state that does "
         "not fit, use FitConfig(sharding=elastic.ShardingConfig(stage=1))"),
        (bool(arg("torch_compile")), "torch_compile", "compile inside model_init if you need "
         "it (untested with elastic)"),
        (arg("label_smoothing_factor", 0) != 0, "label_smoothing_factor", "put the smoothing "
         "in the model's loss (elastic takes the model's loss as it is)"),
        (bool(arg("group_by_length")), "group_by_length", "elastic visits samples in its "
         "public order; sort or bucket the dataset yourself"),
        (bool(arg("batch_eval_metrics")), "batch_eval_metrics", "compute_metrics is already "
         "called per batch and weighted by the batch's samples"),
        (_strategy(arg("optim")) not in SUPPORTED_OPTIMIZERS, "optim", "use one of "
         + ", ".join(SUPPORTED_OPTIMIZERS)),
        (_strategy(arg("lr_scheduler_type")) in ("reduce_lr_on_plateau", "greedy"),
         "lr_scheduler_type", "Trainer steps it on metric_for_best_model after each "
         "evaluation; give elastic a TrainJob with a ReduceLROnPlateau and "
         "training.scheduler_interval='evaluation'"),
        (bool(arg("load_best_model_at_end")), "load_best_model_at_end", "elastic returns the "
         "last step's weights; keep the best with FitConfig(checkpoint=CheckpointConfig("
         "monitor='eval/<metric>', mode=...)) and load it with "
         "elastic.load_checkpoint(path, best=True)"),
        (bool(arg("neftune_noise_alpha")), "neftune_noise_alpha", "add the noise to the "
         "embeddings in the model's forward (elastic trains the model as it is)"),
        (bool(arg("use_liger_kernel")), "use_liger_kernel", "elastic does not patch the model "
         "with Liger's kernels (its fused cross-entropy returns no logits, which elastic's "
         "loss and evaluation read); train without them"),
        (args.max_steps <= 0 and float(args.num_train_epochs) != int(args.num_train_epochs),
         "num_train_epochs", "use a whole number of epochs, or max_steps"),
        (_strategy(arg("eval_strategy")) == "steps" and arg("eval_steps") is not None
         and arg("eval_steps") < 1, "eval_steps", "give a whole number of steps"),
    ]
    for bad, name, instead in checks:
        if bad:
            raise ConfigError(f"TrainingArguments.{name}={arg(name)!r} is not supported by "
                              f"elastic: {instead}")


class _HuggingFace:
    """The factories of a Hugging Face job; picklable with the arguments and data sets."""

    def __init__(self, model_init: Callable[[], Any], args: Any, train_dataset: Any,
                 eval_dataset: Any, data_collator: Any, compute_metrics: Any,
                 processing_class: Any = None) -> None:
        if not callable(model_init) or isinstance(model_init, torch.nn.Module):
            raise ConfigError("hf_job: model_init must be a function that returns the model "
                              f"(as Trainer's model_init), got {type(model_init).__name__}")
        self.model_init, self.args = model_init, args
        self.train, self.eval = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.collator = data_collator if data_collator is not None else _default_collator(
            processing_class)
        self.compute_metrics = compute_metrics
        self.columns: tuple[str, ...] | None = None
        self.token_loss, self.shifts = False, False
        self.steps = 0
        # How this process trains a model's own mean over tokens (`_token_form`): decided on
        # the first micro-batch that can tell, then kept, so that every micro-batch of a
        # step (and every rank: one model) returns the same form.
        self.form: str | None = None

    def inspect(self) -> dict[str, Any]:
        """Reads the model (built on the meta device where it can be) and the arguments:
        the loss form, the forward's columns, the number of steps; returns the settings."""
        try:
            with torch.device("meta"):
                model = self.model_init()
        except Exception:
            model = self.model_init()
        _enable_checkpointing(model, self.args)  # refused here if the model cannot
        self.token_loss, self.shifts = _loss_form(model)
        args = self.args
        if args.remove_unused_columns:
            names = list(inspect.signature(model.forward).parameters)
            self.columns = tuple(dict.fromkeys([*names, "label", "label_ids", "labels",
                                                *(args.label_names or [])]))
        settings = {**self._batch_settings(model), "seed": int(args.seed)}
        settings.update(self._length_settings(settings["batch.global_batch_size"]))
        if args.max_grad_norm and args.max_grad_norm > 0:
            settings["training.clip_grad_norm"] = float(args.max_grad_norm)
        if args.bf16 or args.fp16:
            settings["training.precision"] = "bf16-mixed" if args.bf16 else "fp16-mixed"
        strategy = _strategy(args.eval_strategy)
        if self.eval is not None and strategy != "no":
            settings["evaluation.batch_size"] = int(args.per_device_eval_batch_size)
            if strategy == "steps":
                every = args.eval_steps if args.eval_steps is not None else args.logging_steps
                settings["evaluation.every_steps"] = int(every)
        return settings

    def _batch_settings(self, model: Any) -> dict[str, Any]:
        """The global batch, and with gradient accumulation the micro-batch bound and the
        groups that give `Trainer`'s average over its accumulated batches.

        Raises:
            ConfigError: `Trainer` would not divide the loss by the accumulation steps.
        """
        accumulate = int(self.args.gradient_accumulation_steps)
        per_device = int(self.args.per_device_train_batch_size)
        settings: dict[str, Any] = {"batch.global_batch_size": per_device * accumulate}
        if accumulate == 1:
            return settings
        counted = _accepts_loss_kwargs(model)  # Trainer passes it num_items_in_batch
        if counted and not self._batches_have_labels():
            # Trainer counts items only in batches with "labels" (`_get_num_items_in_batch`);
            # without, it divides each accumulated batch's loss by the accumulation steps, as
            # for a model that takes no count: the groups below give that average.
            counted, self.token_loss = False, False
        if counted and not self.token_loss:
            raise ConfigError(
                f"TrainingArguments.gradient_accumulation_steps={accumulate}: this model takes "
                "num_items_in_batch but its loss is a per-batch mean, so Trainer would not "
                "divide it by the accumulation steps (the update would be that many times "
                "larger); elastic averages over the global batch: set "
                "gradient_accumulation_steps=1 and per_device_train_batch_size to the global "
                "batch (FitConfig.batch.max_micro_batch bounds a worker's memory)")
        settings["batch.max_micro_batch"] = per_device
        if not self.token_loss and not type(model).__name__.endswith(_PER_SAMPLE_HEADS):
            # Trainer averages the losses of its accumulated batches of per_device samples
            # (a model it passes no count): one group each, every
            # forward exactly one of them, weighted alike, gives that average whatever
            # the loss is a mean over (samples or tokens) and whoever runs it. (A head
            # whose loss is a mean over samples needs none: any split gives the average;
            # groups would leave workers beyond the accumulation steps without a share.)
            settings["batch.groups"] = "on"
            settings["batch.group_size"] = per_device
        return settings

    def _length_settings(self, global_batch: int) -> dict[str, Any]:
        """`max_steps`, or the whole epochs; sets the run's number of optimizer steps, over
        which the scheduler runs."""
        args = self.args
        if args.max_steps > 0:
            self.steps = int(args.max_steps)
            return {"max_steps": self.steps}
        epochs = int(args.num_train_epochs)
        per_epoch = len(self.train) // global_batch
        if per_epoch == 0:
            raise ConfigError(f"train_dataset has {len(self.train)} samples, fewer than one "
                              f"global batch of {global_batch}")
        self.steps = epochs * per_epoch
        return {"epochs": epochs}

    def _batches_have_labels(self) -> bool:
        """Whether the batches hold "labels", read from a batch of the first samples as
        `Trainer` reads its first accumulated batch."""
        size = min(len(self.train), int(self.args.per_device_train_batch_size))
        batch = self.collate([self.train[i] for i in range(size)])
        return isinstance(batch, Mapping) and "labels" in batch

    # --- the factories, called on the workers -------------------------------------------------

    def model(self) -> Any:
        """The model as `Trainer.train` prepares it: activation checkpointing as the arguments
        say, and a tokenizer's special tokens in its config."""
        model = self.model_init()
        _enable_checkpointing(model, self.args)
        _align_special_tokens(model, self.processing_class)
        return model

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        from transformers import Trainer

        decay = set(Trainer.get_decay_parameter_names(None, model))
        groups = [
            {"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
             "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in model.named_parameters()
                        if n not in decay and p.requires_grad], "weight_decay": 0.0},
        ]
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, model)
        return cls(groups, **kwargs)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        from transformers import get_scheduler

        args = self.args
        scheduler = get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                                  num_warmup_steps=args.get_warmup_steps(self.steps),
                                  num_training_steps=self.steps,
                                  scheduler_specific_kwargs=args.lr_scheduler_kwargs)
        return AfterAppliedSteps(scheduler, optimizer) if args.fp16 else scheduler

    def loss(self, model: Any, batch: Any) -> Any:
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if self.token_loss and labels is not None:
            counted = labels[..., 1:] if self.shifts else labels
            out = model(**batch, num_items_in_batch=1)  # the model's loss summed over tokens
            return LossSum(_loss_of(out), counted.ne(-100).sum())
        out = model(**batch)
        if self.args.gradient_accumulation_steps == 1 and _per_token(out, labels):
            # The model's own mean over its tokens (BERT's masked LM, T5): Trainer's update is
            # that mean over the whole batch, which a split into micro-batches would weigh
            # by samples; the same cross-entropy summed, over the tokens that count, is not.
            loss, logits = _loss_of(out), out["logits"]
            if self.form is None:
                self.form = _token_form(loss, logits, labels)
            if self.form == "mean":
                return loss if bool(labels.ne(-100).any()) else logits.sum() * 0.0
            return _token_sum(logits, labels, 1 if self.form == "shifted" else 0)
        return _loss_of(out)

    def eval_step(self, model: Any, batch: Any) -> dict[str, tuple[Any, float]]:
        out = model(**batch)
        size = float(_batch_size(batch))
        terms: dict[str, tuple[Any, float]] = {}
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        loss, logits = _eval_outputs(out, labels is not None, _ignored_at_inference(model))
        if loss is not None:
            terms["loss"] = (loss.detach().double() * size, size)
        if self.compute_metrics is not None:
            from transformers import EvalPrediction

            values = self.compute_metrics(EvalPrediction(
                predictions=_numpy(logits),
                label_ids=None if labels is None else labels.cpu().numpy()))
            for name, value in values.items():
                terms[name] = (float(value) * size, size)
        return terms

    def dataset(self) -> Any:
        return self.train

    def eval_data(self) -> Any:
        return self.eval

    def collate(self, samples: list[Any]) -> Any:
        if self.columns is not None and samples and isinstance(samples[0], Mapping):
            samples = [{k: v for k, v in s.items() if k in self.columns} for s in samples]
        return self.collator(samples)


def _default_collator(processing_class: Any) -> Callable[[list[Any]], Any]:
    """`Trainer`'s default collator: `DataCollatorWithPadding` with a tokenizer or a sequence
    feature extractor, `default_data_collator` otherwise."""
    from transformers import (
        DataCollatorWithPadding,
        PreTrainedTokenizerBase,
        SequenceFeatureExtractor,
        default_data_collator,
    )

    if isinstance(processing_class, (PreTrainedTokenizerBase, SequenceFeatureExtractor)):
        return DataCollatorWithPadding(processing_class)
    return default_data_collator


def _align_special_tokens(model: Any, processing_class: Any) -> None:
    """A tokenizer's (or a processor's) pad, bos and eos tokens set in the model's config and
    generation config, as `Trainer.train` sets them."""
    from transformers import PreTrainedTokenizerBase, ProcessorMixin
    from transformers.trainer_utils import align_special_tokens

    if isinstance(processing_class, (PreTrainedTokenizerBase, ProcessorMixin)) and hasattr(
            model, "config"):
        align_special_tokens(model, processing_class)


def _enable_checkpointing(model: Any, args: Any) -> None:
    """Activation checkpointing as `Trainer.train` turns it on: `activation_checkpointing`
    (alias `gradient_checkpointing`), with `activation_checkpointing_kwargs` less its
    `every_n_layers` and `offload`, which go to the model's method by name.

    Raises:
        ConfigError: the model cannot checkpoint its activations.
    """
    enabled = getattr(args, "activation_checkpointing", None)
    if enabled is None:  # an arguments object of a version without the new name
        enabled = getattr(args, "gradient_checkpointing", False)
    if not enabled:
        return
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    try:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                                  every_n_layers=every_n_layers, offload=offload)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None,
                                                every_n_layers=every_n_layers, offload=offload)
    except (AttributeError, ValueError) as e:
        raise ConfigError(f"TrainingArguments.activation_checkpointing=True: "
                          f"{type(model).__name__} cannot checkpoint its activations ({e}); set "
                          "activation_checkpointing=False") from e


def _ignored_at_inference(model: Any) -> list[str]:
    """The output keys `Trainer` leaves out of the predictions: the model config's
    `keys_to_ignore_at_inference` (GPT-2's past_key_values), by default ["cache"]."""
    config = getattr(model, "config", None)
    return [] if config is None else list(getattr(config, "keys_to_ignore_at_inference",
                                                      ["cache"]))


def _eval_outputs(out: Any, has_labels: bool, ignored: Sequence[str] = ()) -> tuple[Any, Any]:
    """The loss (None without one) and the predictions of a model's output, as `Trainer`'s
    `prediction_step` takes them: from a mapping, "loss" and every other value in order but
    those of the `ignored` keys (hidden states and attentions too, when the model returns
    them); from a tuple, the loss first when the batch has labels, the rest; a single
    prediction is itself, not a tuple of one."""
    if isinstance(out, Mapping):
        rest = tuple(v for k, v in out.items()
                     if k != "loss" and k not in ignored and v is not None)
        return out.get("loss"), rest[0] if len(rest) == 1 else rest
    items = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    loss, rest = (items[0], items[1:]) if has_labels and len(items) > 1 else (None, items)
    return loss, rest[0] if len(rest) == 1 else rest


def _numpy(value: Any) -> Any:
    """Predictions for `EvalPrediction`: tensors as float numpy arrays, tuples kept."""
    if isinstance(value, (tuple, list)):
        return tuple(_numpy(v) for v in value)
    return value.detach().float().cpu().numpy()


def _per_token(out: Any, labels: Any) -> bool:
    """Whether `labels` are one class per token of `out`'s logits (a masked or
    sequence-to-sequence LM, token classification): labels of two or more dimensions whose
    shape is the logits' without their last."""
    logits = out.get("logits") if isinstance(out, Mapping) else None
    return (isinstance(labels, torch.Tensor) and isinstance(logits, torch.Tensor)
            and labels.dim() >= 2 and not labels.is_floating_point()
            and tuple(logits.shape[:-1]) == tuple(labels.shape))


def _token_sum(logits: torch.Tensor, labels: torch.Tensor, shift: int) -> LossSum:
    """The cross-entropy of `logits` against `labels` (shifted by `shift`, as a causal LM
    takes them) summed over the tokens whose label is not -100, and their count."""
    labels = labels.to(logits.device)
    here = logits[..., :-1, :] if shift else logits
    target = labels[..., 1:] if shift else labels
    total = torch.nn.functional.cross_entropy(
        here.float().reshape(-1, here.shape[-1]), target.reshape(-1), ignore_index=-100,
        reduction="sum")
    return LossSum(total, target.ne(-100).sum())


def _token_form(loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> str | None:
    """Which token cross-entropy the model's own mean `loss` is: "plain" (labels as they are),
    "shifted" (by one, as a causal LM takes them), the closer of the two within 1e-4; "mean"
    when neither (a loss of the model's own making: weights, an extra term; or not in float32
    or float64), trained as it is, weighed by samples (a warning says so once); None when
    this micro-batch cannot tell (no token counts, or the loss is not finite)."""
    if loss.dtype not in (torch.float32, torch.float64):
        return "mean"
    if not bool(torch.isfinite(loss.detach())):
        return None
    gaps = {}
    for form, shift in (("plain", 0), ("shifted", 1)):
        summed = _token_sum(logits.detach(), labels, shift)
        if int(summed.count):
            mean = summed.total / summed.count
            if torch.allclose(mean, loss.detach().to(mean.dtype), rtol=1e-4, atol=1e-6):
                gaps[form] = float((mean - loss.detach()).abs())
    if gaps:
        return min(gaps, key=gaps.get)
    if not bool(labels.ne(-100).any()):
        return None
    _warn_once("hf_job: the model's loss is not the mean cross-entropy of its logits over the "
               "labels that are not -100, as they are or shifted; it is trained as a mean per "
               "sample, so a batch split across workers weighs its tokens by how few share "
               "their micro-batch (Trainer: one mean over the batch). Return an "
               "elastic.LossSum from a TrainJob of your own for the same update at any split")
    return "mean"


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def _accepts_loss_kwargs(model: Any) -> bool:
    """Whether `Trainer` passes `num_items_in_batch` to `model` (its rule)."""
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD
                      for p in inspect.signature(model.forward).parameters.values())
    return bool(accepts)


def _loss_form(model: Any) -> tuple[bool, bool]:
    """Whether `model`'s loss is a token sum over `num_items_in_batch`: `Trainer` passes it
    (the forward takes loss keyword arguments), the forward computes its loss with
    `self.loss_function` (models such as BERT's masked LM or T5 use their own mean
    cross-entropy and ignore it), and that is a token cross-entropy. And, as `Trainer` counts,
    whether the count is over `labels[..., 1:]` (`loss_type` maps to the causal LM loss and
    the model is not an encoder-decoder)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    function = getattr(model, "loss_function", None)
    token = (_accepts_loss_kwargs(model) and _passes_item_count(type(model).forward)
             and getattr(function, "__name__", "") in _TOKEN_LOSSES)
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    shifts = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    return token, token and shifts and not encoder_decoder


def _passes_item_count(forward: Any) -> bool:
    """Whether `forward` calls `self.loss_function` with `num_items_in_batch`, by name or in
    `**kwargs` (the generic token classification head calls it with neither, so its loss is
    a mean whatever `Trainer` passes)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr == "loss_function"
               and any(k.arg in (None, "num_items_in_batch") for k in node.keywords)
               for node in ast.walk(tree))


def _loss_of(out: Any) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, Mapping) else out[0]
    if loss is None:
        raise ValueError("the model returned no loss: the batch needs its labels (a 'labels' "
                         "column, or label_names in TrainingArguments)")
    return loss


def _batch_size(batch: Any) -> int:
    for value in (batch.values() if isinstance(batch, Mapping) else batch):
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    raise ValueError("cannot tell the evaluation batch's size: it has no tensor")


class AfterAppliedSteps:
    """A scheduler stepped only after a step the optimizer applied: with fp16, `Trainer`
    does not step it after a step the gradient scaler skipped (elastic's scheduler steps
    after every committed step, skipped ones included)."""

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
        self.scheduler, self.optimizer = scheduler, optimizer
        self.applied = self.seen = 0
        optimizer.register_step_post_hook(self._applied)

    def _applied(self, *_: Any) -> None:
        self.applied += 1

    def step(self, *args: Any) -> None:
        if self.applied > self.seen:
            self.seen = self.applied
            self.scheduler.step(*args)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()
