"""What a replica is built from, checked: the job's model (no layer with sparse gradients),
its loader processes (started, and waited for while they build the data set), and which of
its layers draw random numbers (for `batch.groups` 'auto')."""

from __future__ import annotations

import logging

import torch

from elastic.config import DataConfig
from elastic.errors import ConfigError
from elastic.job import TrainJob
from elastic.trainer.loader import Prefetcher

logger = logging.getLogger(__name__)

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


def start_loaders(job: TrainJob, data: DataConfig, data_rng: torch.Tensor,
                   built_in: float) -> Prefetcher | None:
    """The worker's loader processes (none without `data.loader_workers`), started.

    They have built the data set before the worker reports itself started: a worker that
    joins a running generation then holds no rank's step while its loaders build it. They are
    not waited on for long past what the worker's own build took (`built_in` seconds; they
    build it side by side): a loader stuck in the factory is then found at the first step (as
    a hung data phase), not left holding the worker's start."""
    if not data.loader_workers:
        return None
    prefetcher = Prefetcher(job, data.loader_workers, data.start_method, data_rng, data.pin_memory)
    patience = max(_LOADER_START_MIN_S, 3 * built_in)
    try:
        if not prefetcher.wait_started(patience):
            logger.warning("the loader processes had not built the data set %.0f s after the "
                           "worker had; the first step waits for them", patience)
    except BaseException:
        prefetcher.close()
        raise
    return prefetcher


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
