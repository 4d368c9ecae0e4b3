"""What a replica is built from, checked: the job's model (no layer with sparse gradients),
its optimizer and scheduler, its data set, its loader processes (started, and waited for while
they build the data set), and which of its layers draw random numbers (for `batch.groups`
'auto')."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from elastic.config import DataConfig, FitConfig, TrainingConfig
from elastic.errors import ConfigError
from elastic.job import TrainJob
from elastic.trainer.data import SampleOrder, steps_per_epoch
from elastic.trainer.loader import Prefetcher, seed_others_from_torch
from elastic.trainer.training import Training, build_extra_state, wants_model

logger = logging.getLogger(__name__)

# Largest data set whose indices travel exactly in a float32 buffer (the ledger's).
_FLOAT32_EXACT = 1 << 24
# A worker waits for its loader processes to build the data set for at most 3x its own build
# time, and at least this long (a spawned loader imports torch first: seconds).
_LOADER_START_MIN_S = 30.0


def built_model(job: TrainJob) -> torch.nn.Module:
    """The job's model, checked.

    Raises:
        ConfigError: the factory returned no `torch.nn.Module`, or a layer makes sparse
            gradients (the step sums dense gradient buffers over ranks).
    """
    model = job.model()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"TrainJob.model returned {type(model).__name__}, not a torch.nn.Module")
    sparse = [name or type(model).__name__ for name, m in model.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ConfigError(
            f"TrainJob.model: {', '.join(map(repr, sparse))} make sparse gradients (sparse=True), which "
            "elastic does not support: its steps sum dense gradient buffers over the ranks; "
            "build them with sparse=False (and a dense optimizer instead of SparseAdam)")
    return model


def built_optimizer(job: TrainJob, model: torch.nn.Module, training: TrainingConfig
                    ) -> tuple[torch.optim.Optimizer, Any, Training, Any]:
    """The optimizer (from the model's parameters, or from the model when the factory asks
    for it: `wants_model`), the scheduler, their `Training` and the extra state.

    Raises:
        ConfigError: the factory returned no optimizer, or the scheduler steps after
            evaluations of a job that has none.
    """
    optimizer = job.optimizer(model if wants_model(job.optimizer) else model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"TrainJob.optimizer returned {type(optimizer).__name__}, not a "
                          "torch.optim.Optimizer")
    scheduler = job.lr_scheduler(optimizer) if job.lr_scheduler else None
    steps = Training(training, scheduler)
    if training.scheduler_interval == "evaluation" and job.eval_step is None:
        raise ConfigError("training.scheduler_interval 'evaluation' steps the scheduler "
                          "after each evaluation, but the job has no TrainJob.eval_step "
                          "and eval_dataset to evaluate")
    return optimizer, scheduler, steps, build_extra_state(job, model, optimizer)


@dataclass(frozen=True)
class BuiltData:
    """The job's training data set and what reads it."""

    dataset: Any
    collate: Callable[[list[Any]], Any]
    order: SampleOrder
    rng_state: torch.Tensor  # torch's generator state in which `job.dataset()` was called
    built_in: float  # seconds the factory took


def built_data(job: TrainJob, config: FitConfig) -> BuiltData:
    """The job's data set, built under torch's current generator state and Python's and
    NumPy's seeded from it (the loader processes build it from that state too), checked.

    Raises:
        ConfigError: not a map-style data set, loader processes for a Ray data set, fewer
            samples than one global batch, or a ledger over more than 2**24 samples.
    """
    rng_state = torch.get_rng_state()
    seed_others_from_torch()  # Python's and NumPy's too: the same data set on every rank
    building = time.monotonic()
    dataset = job.dataset()
    built_in = time.monotonic() - building
    # An IterableDataset with a __len__ (webdataset's with_length) still has torch's
    # Dataset.__getitem__, which raises at the first step.
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or isinstance(
            dataset, torch.utils.data.IterableDataset):
        raise ConfigError(f"TrainJob.dataset returned {type(dataset).__name__}, not a map-style "
                          "dataset (it needs __len__ and __getitem__; an IterableDataset is "
                          "read in its own order, which elastic cannot split exactly once)")
    if config.data.loader_workers and not getattr(dataset, "uses_loader_processes", True):
        raise ConfigError(
            f"data.loader_workers: a {type(dataset).__name__} is read through Ray, and "
            "loader processes are not Ray workers; set data.loader_workers=0 (Ray Data ran "
            "its transforms in parallel already)")
    try:
        steps_per_epoch(len(dataset), config.batch.global_batch_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if config.ledger and len(dataset) > _FLOAT32_EXACT:
        raise ConfigError("ledger=True supports data sets of up to 2**24 samples")
    return BuiltData(dataset, job.collate_fn or default_collate,
                     SampleOrder(len(dataset), config.seed, dataset), rng_state, built_in)


def start_loaders(job: TrainJob, data: DataConfig, data_rng: torch.Tensor,
                   built_in: float, device: torch.device | None = None) -> Prefetcher | None:
    """The worker's loader processes (none without `data.loader_workers`), started.

    They have built the data set before the worker reports itself started: a worker that
    joins a running generation then holds no rank's step while its loaders build it. They are
    not waited on for long past what the worker's own build took (`built_in` seconds; they
    build it side by side): a loader stuck in the factory is then found at the first step (as
    a hung data phase), not left holding the worker's start. `device`: the worker's GPU, for
    the thread that pins batches (`data.pin_memory`)."""
    if not data.loader_workers:
        return None
    prefetcher = Prefetcher(job, data.loader_workers, data.start_method, data_rng, data.pin_memory,
                            device)
    patience = max(_LOADER_START_MIN_S, 3 * built_in)
    try:
        if not prefetcher.wait_started(patience):
            logger.warning("the loader processes had not built the data set %.0f s after the "
                           "worker had; the first step waits for them", patience)
    except BaseException:
        prefetcher.close()
        raise
    return prefetcher


def model_traits(model: torch.nn.Module) -> dict[str, int]:
    """What the controller needs to know about the model to cut the batch: its BatchNorm
    layers and its layers that draw random numbers (`random_layer`; `batch.groups` 'auto')."""
    modules = list(model.modules())
    return {"batchnorm": sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in modules),
            "dropout": sum(map(random_layer, modules))}


def random_layer(module: torch.nn.Module) -> bool:
    """Whether `module` draws random numbers of its own in training: a dropout layer
    (`nn.Dropout*`, `nn.AlphaDropout`) or `nn.RReLU`; a recurrent layer with dropout between
    its layers (`nn.LSTM/GRU/RNN`, `num_layers` > 1); stochastic depth (torchvision's
    `StochasticDepth`, or a class named `*Drop*` with a float `p` above 0, as timm's
    `DropPath`); and any module that keeps a probability above 0 in a float attribute named
    like `*drop*` (`nn.MultiheadAttention`'s `dropout`, the `attention_dropout` of Hugging Face
    attention, `drop_prob`, `drop_path_rate`). A module that draws in other ways (`torch.rand`
    in a forward) is not seen: `batch.groups = 'on'` covers it."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, torch.nn.RReLU):
        return True
    if isinstance(module, torch.nn.RNNBase):
        return module.dropout > 0 and module.num_layers > 1
    named = type(module).__name__
    if "drop" in named.lower() or named == "StochasticDepth":
        p = getattr(module, "p", None)
        if isinstance(p, float) and p > 0:
            return True
    return any("drop" in name.lower() and isinstance(value, float) and value > 0
               for name, value in vars(module).items())
