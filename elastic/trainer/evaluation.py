"""Distributed evaluation: every member evaluates its slice of the evaluation set, and the
metrics' sums and counts are summed over the generation's communicator.

The evaluation set (`TrainJob.eval_dataset`) is split into contiguous slices of
`range(len(eval_set))` in proportion to the batch plan's shares (`eval_slices`, with the
planner's `apportion`); each rank reads only its slice, in batches of
`EvaluationConfig.batch_size`, and runs `TrainJob.eval_step` on each under `torch.no_grad()`
with the model in eval mode. Per metric, the sums and counts are accumulated in float64; the
metric is the sum over the whole set divided by the count, identical on every rank.

Every rank issues the same collectives whatever happened in its part, so that no rank is left
waiting: first one float64 allreduce of a header in which each rank writes only its own
slots (its error flag, how many metric names it has and a 52-bit hash of them, the byte length
of the names, and the size of its evaluation set); what the summed header says is decided by a
pure function (`judge`), so every rank decides the same. An error in user code on any rank
(building the set, reading, collating, `eval_step`, a malformed result) becomes an
`EvalFailure` on every rank; so do metric names or set sizes that differ between ranks. Only
when the header is clean do the ranks exchange the names (when some rank has none: an empty
slice) and then the sums and counts. The evaluation does not disturb training: the global
generators (torch's CPU and CUDA, Python's, NumPy's) and every module's training flag are
restored afterwards, and each batch's generators are seeded from the run's seed and the
position of its first sample, never from the rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.adapt.groups import forward_seed
from elastic.adapt.plan import apportion
from elastic.collective import Communicator
from elastic.config import FitConfig
from elastic.trainer.loader import generator_state, load_piece, seed_generators, set_generator_state
from elastic.trainer.loss import LossSum
from elastic.trainer.outcomes import EvalFailure

__all__ = ["EvalFailure", "LazyDataset", "Partial", "Verdict", "eval_batch_size", "eval_mode",
           "eval_slices", "evaluate_share", "evaluate_slice", "judge", "metric_terms", "names_hash",
           "preserved_generators", "reduce_partial"]

# The `step` key of the evaluation's generator streams: one no training step reaches.
_EVAL_STREAM = 1 << 62
_HEADER = 5  # slots per rank: error, number of names, names hash, names bytes, set size


def eval_batch_size(config: FitConfig) -> int:
    """Samples per evaluation batch: `evaluation.batch_size`, else `batch.max_micro_batch`,
    else `batch.global_batch_size`."""
    return (config.evaluation.batch_size or config.batch.max_micro_batch
            or config.batch.global_batch_size)


def eval_slices(size: int, shares: Sequence[int]) -> list[range]:
    """Contiguous slices of `range(size)`, one per rank in rank order, sized in proportion to
    the batch plan's `shares` (largest remainder, as the planner splits the global batch); a
    rank whose share is 0 gets an empty slice."""
    working = [rank for rank, share in enumerate(shares) if share > 0]
    sizes = [0] * len(shares)
    if size > 0 and working:
        for rank, part in zip(working, apportion(size, [shares[r] for r in working]), strict=True):
            sizes[rank] = part
    slices, start = [], 0
    for part in sizes:
        slices.append(range(start, start + part))
        start += part
    return slices


def names_hash(names: Sequence[str]) -> int:
    """A 52-bit hash of the sorted metric names (exact in a float64)."""
    digest = hashlib.sha256("\0".join(sorted(names)).encode()).digest()
    return int.from_bytes(digest[:7], "big") >> 4


class LazyDataset:
    """The evaluation set, built on first use from its factory with the generators seeded by
    the run's seed (every rank builds the same set) and restored afterwards.

    Args:
        factory: `TrainJob.eval_dataset`.
        seed: the run's seed.
    """

    def __init__(self, factory: Callable[[], Any], seed: int) -> None:
        self.factory = factory
        self.seed = seed
        self._dataset: Any = None

    def get(self) -> Any:
        """The data set (built now if not yet; a factory that raised is called again next time).

        Raises:
            TypeError: the factory returned something without `__len__` and `__getitem__`.
        """
        if self._dataset is None:
            with preserved_generators():
                seed_generators(self.seed)
                dataset = self.factory()
            if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
                raise TypeError(f"TrainJob.eval_dataset returned {type(dataset).__name__}, not a "
                                "map-style dataset (it needs __len__ and __getitem__)")
            self._dataset = dataset
        return self._dataset


@contextlib.contextmanager
def preserved_generators() -> Iterator[None]:
    """Restores the global generators (torch's CPU and, if initialised, CUDA ones, Python's,
    NumPy's) on exit."""
    state = generator_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        set_generator_state(state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`torch.no_grad()` with every module in eval mode; each module's own training flag is
    restored on exit (a module the user froze in eval mode stays so)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def _number(value: Any, what: str) -> float:
    """A Python number or a one-element tensor as a float."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{what} must be a number or a one-element tensor, got a tensor of "
                            f"shape {tuple(value.shape)}")
        return float(value.detach().to(torch.float64).item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{what} must be a number or a one-element tensor, got {type(value).__name__}")


def metric_terms(out: Any) -> dict[str, tuple[float, float]]:
    """What one `eval_step` call returned, as {name: (sum, count)} floats.

    Raises:
        TypeError: not a dict of name -> (sum, count) or `LossSum`.
    """
    if not isinstance(out, dict):
        raise TypeError(f"TrainJob.eval_step must return a dict {{name: (sum, count)}}, got "
                        f"{type(out).__name__}")
    terms = {}
    for name, value in out.items():
        if not isinstance(name, str) or not name or "\0" in name:
            raise TypeError(f"TrainJob.eval_step returned a metric name {name!r}; names are "
                            "non-empty str without NUL characters")
        if isinstance(value, LossSum):
            total, count = value.total, value.count
        elif isinstance(value, (tuple, list)) and len(value) == 2:
            total, count = value
        else:
            raise TypeError(f"TrainJob.eval_step returned {type(value).__name__} for metric "
                            f"{name!r}; return (sum, count) or elastic.LossSum(sum, count)")
        terms[name] = (_number(total, f"the sum of metric {name!r}"),
                       _number(count, f"the count of metric {name!r}"))
    return terms


def evaluate_slice(model: torch.nn.Module, dataset: Any, collate: Callable[[list[Any]], Any],
                   eval_step: Callable[[Any, Any], Any], indices: range, batch_size: int,
                   seed: int, tick: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Runs `eval_step` over `indices` of `dataset` in batches of `batch_size`; returns
    {name: [sum, count]} accumulated in float64 (empty for an empty slice). The model is in
    eval mode under `torch.no_grad()`; the generators are seeded before each batch from
    (`seed`, position of its first sample) and restored afterwards, as are the modules' modes.
    `tick` is called before each batch (the hang watchdog sees a slice that moves on).

    Raises:
        whatever user code raised; TypeError for a malformed result, ValueError when batches
        return different metric names.
    """
    sums: dict[str, list[float]] = {}
    with preserved_generators(), eval_mode(model):
        for start in range(indices.start, indices.stop, batch_size):
            if tick is not None:
                tick()
            batch_indices = list(range(start, min(start + batch_size, indices.stop)))
            batch = load_piece(dataset, collate, batch_indices,
                               forward_seed(seed, _EVAL_STREAM, start))
            terms = metric_terms(eval_step(model, batch))
            if sums and terms.keys() != sums.keys():
                raise ValueError(f"TrainJob.eval_step returned the metrics {sorted(terms)} for "
                                 f"samples {start}.., but {sorted(sums)} before; every batch "
                                 "must return the same names")
            for name, (total, count) in terms.items():
                acc = sums.setdefault(name, [0.0, 0.0])
                acc[0] += total
                acc[1] += count
    return sums


@dataclass
class Partial:
    """One rank's part of an evaluation before the reduce.

    Attributes:
        sums: {name: [sum, count]} over this rank's slice.
        size: the size of the evaluation set as this rank read it (-1 if it could not).
        error: this rank's traceback if user code raised.
    """

    sums: dict[str, list[float]] = field(default_factory=dict)
    size: int = -1
    error: str | None = None

    def header(self, rank: int, world_size: int) -> torch.Tensor:
        """This rank's contribution to the header (`_HEADER` slots per rank, its own only)."""
        header = torch.zeros(_HEADER * world_size, dtype=torch.float64)
        names = sorted(self.sums)
        mine = [float(self.error is not None), float(len(names)),
                float(names_hash(names)) if names else 0.0,
                float(len(_encode(names))) if names else 0.0, float(self.size)]
        header[_HEADER * rank : _HEADER * (rank + 1)] = torch.tensor(mine, dtype=torch.float64)
        return header


@dataclass(frozen=True)
class Verdict:
    """What the summed header says, the same on every rank: a failure, or how to go on.

    Attributes:
        failure: set when the evaluation failed on every rank.
        names_from: the lowest rank with metric names (-1: no rank has any).
        names_bytes: the byte length of the encoded names.
        num_names: how many metrics.
        share_names: some rank has none and must receive them.
    """

    failure: EvalFailure | None = None
    names_from: int = -1
    names_bytes: int = 0
    num_names: int = 0
    share_names: bool = False


def judge(header: Sequence[float], rank: int, own_error: str | None) -> Verdict:
    """Reads the summed header (see `Partial.header`); pure, so every rank decides the same.
    User errors come first, then different set sizes, then different metric names."""
    rows = [header[i : i + _HEADER] for i in range(0, len(header), _HEADER)]
    failed = tuple(r for r, row in enumerate(rows) if row[0] > 0)
    if failed:
        return Verdict(failure=EvalFailure(failed, own_error if rank in failed else None))
    sizes = sorted({int(row[4]) for row in rows})
    if len(sizes) > 1:
        return Verdict(failure=EvalFailure(tuple(range(len(rows))), (
            f"TrainJob.eval_dataset has different sizes on different ranks ({sizes}); the "
            "factory must build the same data set on every worker")))
    named = [r for r, row in enumerate(rows) if row[1] > 0]
    if not named:
        return Verdict()
    first = rows[named[0]]
    differ = tuple(r for r in named if tuple(rows[r][1:4]) != tuple(first[1:4]))
    if differ:
        return Verdict(failure=EvalFailure((named[0], *differ), (
            f"TrainJob.eval_step returned different metric names on ranks {named[0]} and "
            f"{list(differ)}; every batch must return the same names on every rank")))
    return Verdict(names_from=named[0], names_bytes=int(first[3]), num_names=int(first[1]),
                   share_names=len(named) < len(rows))


def _encode(names: Sequence[str]) -> bytes:
    return "\0".join(sorted(names)).encode()


def _enter(progress: Any, phase: str) -> None:
    """Tells the hang watchdog where this rank is (`Replica.progress`), when it is watched."""
    if progress is not None:
        progress.since = time.monotonic()  # first: the watchdog never pairs a new phase with
        progress.phase = phase  # an old start


def _local(dataset: LazyDataset, model: torch.nn.Module, collate: Callable[[list[Any]], Any],
           eval_step: Callable[[Any, Any], Any], shares: Sequence[int], rank: int,
           batch_size: int, seed: int, before: Callable[[], None] | None,
           progress: Any = None) -> Partial:
    """This rank's part; an exception from user code is latched with its traceback, never
    raised, so that this rank still joins the reduce."""
    partial = Partial()
    try:
        if before is not None:
            before()
        data = dataset.get()
        partial.size = len(data)
        mine = eval_slices(partial.size, shares)[rank]
        partial.sums = evaluate_slice(model, data, collate, eval_step, mine, batch_size, seed,
                                      tick=lambda: _enter(progress, "evaluate"))
    except Exception:
        partial.sums, partial.error = {}, traceback.format_exc()
    return partial


def evaluate_share(comm: Communicator, model: torch.nn.Module, dataset: LazyDataset,
                   collate: Callable[[list[Any]], Any], eval_step: Callable[[Any, Any], Any],
                   shares: Sequence[int], batch_size: int, seed: int,
                   before: Callable[[], None] | None = None,
                   progress: Any = None) -> dict[str, float] | EvalFailure:
    """Evaluates this rank's slice and reduces the metrics over `comm`; every rank of the
    generation calls it with the same `shares` (the batch plan's, one per rank).

    Args:
        comm: the generation's communicator.
        model: this replica's model (its committed weights, the same on every rank).
        dataset: the evaluation set.
        collate: turns a list of samples into a batch.
        eval_step: `TrainJob.eval_step`.
        shares: the batch plan's shares; the set is split in proportion to them.
        batch_size: samples per `eval_step` call.
        seed: the run's seed (each batch's generators are seeded from it and the position).
        before: called before this rank reads anything (chaos faults of phase 'evaluate');
            what it raises counts as an error of user code.
        progress: `Replica.progress`, updated for the hang watchdog.

    Returns:
        {name: sum / count} over the whole set (NaN where the count is 0), identical on every
        rank, or the `EvalFailure` every rank reports.

    Raises:
        CollectiveError: the communication failed or was aborted (a peer died).
    """
    _enter(progress, "evaluate")
    partial = _local(dataset, model, collate, eval_step, shares, comm.rank, batch_size, seed,
                     before, progress)
    _enter(progress, "allreduce")
    try:
        return reduce_partial(comm, partial)
    finally:
        _enter(progress, "idle")


def reduce_partial(comm: Communicator, partial: Partial) -> dict[str, float] | EvalFailure:
    """Sums every rank's `partial` over `comm`: the header, then (when the verdict is clean)
    the names to ranks that have none, then the sums and counts. Every rank calls it.

    Raises:
        CollectiveError: the communication failed or was aborted.
    """
    comm = comm.control  # host tensors only
    header = comm.allreduce(partial.header(comm.rank, comm.world_size))
    verdict = judge(header.tolist(), comm.rank, partial.error)
    if verdict.failure is not None:
        return verdict.failure
    if verdict.names_from < 0:
        return {}
    names = sorted(partial.sums)
    if verdict.share_names:
        encoded = torch.zeros(verdict.names_bytes, dtype=torch.uint8)
        if comm.rank == verdict.names_from:
            encoded.copy_(torch.frombuffer(bytearray(_encode(names)), dtype=torch.uint8))
        comm.broadcast(encoded, verdict.names_from)
        names = bytes(encoded.tolist()).decode().split("\0")
    k = verdict.num_names
    values = torch.zeros(2 * k, dtype=torch.float64)  # sums, then counts; zeros on empty ranks
    for i, name in enumerate(names):
        if name in partial.sums:
            values[i], values[k + i] = partial.sums[name]
    comm.allreduce(values)
    return {name: total / count if count != 0 else math.nan
            for name, total, count in zip(names, values[:k].tolist(), values[k:].tolist(), strict=True)}
