"""`elastic bench overhead`: `elastic.fit` against a plain `DistributedDataParallel` loop on
gloo, same model, data, global batch and world size, in one invocation.

The DDP processes are spawned by the benchmark (torch.multiprocessing, a FileStore
rendezvous, one thread each like a Ray worker with one CPU). Both take the same samples per
step (the public order, even shares). Reported per run, medians over the measured steps of the
slowest rank: the in-step time (data loading to optimizer step, measured inside each worker)
and its phases (data, forward/backward, exposed communication, optimizer, the rest of the
step); the wall-clock time per step (from one step's end to the next one's); and the idle gaps
between steps, each from a step's end (on the last rank to end it) to the next one's start (on
the last rank to start it). For `elastic.fit` the gaps at chunk boundaries (the controller's
round trip: every `steps_per_chunk` steps, the run's default unless asked otherwise, and at
each epoch's end) are told apart from those inside a chunk.

Models: an MLP and a CNN classifying synthetic images, and a small causal transformer
language model on token sequences of varying length padded to a fixed one.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from elastic import LossSum
from elastic.api import fit
from elastic.bench import classification_loss, leave_ddp, run_ddp, sgd
from elastic.config import BatchConfig, CollectiveConfig, FitConfig, ScalingConfig
from elastic.job import TrainJob

CLASSIFIERS = ("mlp", "cnn")
MODELS = (*CLASSIFIERS, "lm")
SAMPLES = 8192
# The language model's sequences: LENGTH + 1 tokens, of which the first MIN_TOKENS to LENGTH + 1
# are real (ids 1 to VOCAB - 1) and the rest PAD; input positions 0..LENGTH-1, targets 1..LENGTH.
VOCAB, LENGTH, PAD, MIN_TOKENS = 1000, 16, 0, 4
# The in-step phases of a metrics line of `elastic.fit` (and of the DDP loop's rows).
PHASES = ("data_s", "forward_backward_s", "comm_s", "optimizer_s")


def make_dataset(model: str) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    if model == "lm":
        tokens = torch.randint(1, VOCAB, (SAMPLES, LENGTH + 1), generator=g)
        real = torch.randint(MIN_TOKENS, LENGTH + 2, (SAMPLES,), generator=g)
        tokens[torch.arange(LENGTH + 1) >= real[:, None]] = PAD
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    shape = (SAMPLES, 784) if model == "mlp" else (SAMPLES, 3, 32, 32)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, 10, (SAMPLES,), generator=g)
    return TensorDataset(x, y)


class TinyLM(nn.Module):
    """A causal transformer language model: token and position embeddings, two encoder layers
    under a causal mask (no dropout), a linear head over the vocabulary. Position t attends to
    positions up to t only, so padding after a sequence's end changes no logit whose target
    is a real token."""

    def __init__(self, d_model: int = 128, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d_model)
        self.positions = nn.Embedding(LENGTH, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, length, VOCAB) for token ids `x` of shape (batch, length)."""
        length = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=x.device)
        h = self.tokens(x) + self.positions(torch.arange(length, device=x.device))
        return self.head(self.encoder(h, mask=mask, is_causal=True))


def make_model(model: str) -> nn.Module:
    if model == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    if model == "lm":
        return TinyLM()
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def token_loss_sum(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    """The language model's loss in `elastic.fit`: the cross-entropy summed over the targets
    that are not padding, and their number; the step's loss is then the mean over the global
    batch's tokens, whatever the shares."""
    x, y = batch
    total = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=PAD,
                                        reduction="sum")
    return LossSum(total, (y != PAD).sum())


def _ddp_loss(model: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The DDP loop's loss. The language model's is each rank's own token mean (the usual
    `ignore_index` loss): with ranks holding different numbers of tokens, DDP's averaged
    gradient is not that of the global token mean that `elastic.fit` takes; this benchmark
    compares speed (the work per step is the same), not the updates."""
    if model == "lm":
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1), ignore_index=PAD)
    return nn.functional.cross_entropy(out, y)


_optimizer = functools.partial(sgd, momentum=0.9)


def make_job(model: str) -> TrainJob:
    """The `elastic.fit` job of `model`: the classifiers' mean loss, the language model's
    token sum and count."""
    return TrainJob(model=functools.partial(make_model, model), optimizer=_optimizer,
                    loss=token_loss_sum if model == "lm" else classification_loss,
                    dataset=functools.partial(make_dataset, model))


def chunk_starts(steps: int, steps_per_chunk: int, steps_per_epoch: int) -> list[int]:
    """The steps that start a chunk in an `elastic.fit` run of `steps` steps with no
    checkpoints, evaluation, chaos or micro-batch trials: a chunk has `steps_per_chunk` steps
    at most and ends at the end of each epoch (as `elastic.control.decisions.chunk_length`)."""
    starts, step = [], 0
    while step < steps:
        starts.append(step)
        step += min(steps_per_chunk, steps - step, steps_per_epoch - step % steps_per_epoch)
    return starts


@dataclass(frozen=True)
class Breakdown:
    """Where one run's time per step goes, in seconds, over its measured steps. A step's
    in-step time and phases are its slowest rank's (the longest in-step time); its gap (idle)
    is the time from the previous step's end on the last rank to end it to the step's start on
    the last rank to start it (a step cannot end before its last rank has started it)."""

    step_s: float  # median in-step time
    wall_s: float  # mean time from one step's end to the next one's (the last rank's)
    data_s: float  # the phases: medians
    forward_backward_s: float  # DDP: with its allreduce, which overlaps the backward pass
    comm_s: float  # exposed communication (DDP: 0, it cannot be told apart from backward)
    optimizer_s: float
    other_s: float  # median of the in-step time less the four phases
    idle_s: float  # mean gap
    idle_in_chunk_s: float | None  # median gap of the steps inside a chunk (None: no such step)
    idle_at_boundary_s: float | None  # median gap of the steps that start a chunk (None: none)


def breakdown(rows: Sequence[Mapping[str, float]], warmup: int,
              chunk_starts: Collection[int] = ()) -> Breakdown:
    """The breakdown of one run, leaving out its first `warmup` steps.

    Args:
        rows: one per step, in step order from step 0: `step`, `start` (when the last rank to
            start the step started it, seconds since the epoch), `time` (when the last rank to
            end it ended it), `step_time_s` (the slowest rank's in-step time) and that rank's
            `PHASES` (a metrics line of `elastic.fit` has all but `start`).
        warmup: steps left out; at least 1 (the first measured step's gap needs the one before).
        chunk_starts: the steps that start a chunk (none for DDP: every gap is inside).

    Returns:
        The medians and means over the measured steps.
    """
    assert [r["step"] for r in rows] == list(range(len(rows))), "one row per step, in order"
    assert 1 <= warmup < len(rows)
    measured = rows[warmup:]
    gaps = [(r["step"], r["start"] - before["time"])
            for before, r in zip(rows[warmup - 1 : -1], measured, strict=True)]
    inside = [g for step, g in gaps if step not in chunk_starts]
    at = [g for step, g in gaps if step in chunk_starts]
    return Breakdown(
        step_s=statistics.median(r["step_time_s"] for r in measured),
        wall_s=(rows[-1]["time"] - rows[warmup - 1]["time"]) / len(measured),
        data_s=statistics.median(r["data_s"] for r in measured),
        forward_backward_s=statistics.median(r["forward_backward_s"] for r in measured),
        comm_s=statistics.median(r["comm_s"] for r in measured),
        optimizer_s=statistics.median(r["optimizer_s"] for r in measured),
        other_s=statistics.median(r["step_time_s"] - sum(r[p] for p in PHASES) for r in measured),
        idle_s=statistics.fmean(g for _, g in gaps),
        idle_in_chunk_s=statistics.median(inside) if inside else None,
        idle_at_boundary_s=statistics.median(at) if at else None,
    )


def run_metrics(result: Any) -> list[dict[str, Any]]:
    """A finished run's metrics lines as metrics.jsonl holds them, per-rank timelines too
    (`FitResult.metrics` leaves those out)."""
    from elastic.events import read_jsonl

    return read_jsonl(os.path.join(result.run_dir, "metrics.jsonl"))


def elastic_rows(metrics: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The metrics lines of `elastic.fit` in step order, each with `start`: the latest of the
    ranks' step starts (the first entry of each rank's `timeline`)."""
    return [{**m, "start": max(t[0] for t in m["timeline"] if t)}
            for m in sorted(metrics, key=lambda m: m["step"])]


def median_breakdown(runs: Sequence[Breakdown]) -> Breakdown:
    """Field by field, the median over `runs` (None where a run has none)."""
    values: dict[str, Any] = {}
    for f in fields(Breakdown):
        xs = [getattr(b, f.name) for b in runs]
        values[f.name] = None if None in xs else statistics.median(xs)
    return Breakdown(**values)


@dataclass
class OverheadResult:
    model: str
    workers: int
    global_batch_size: int
    steps: int
    warmup: int
    steps_per_chunk: int
    chunk_boundaries: list[int]  # the measured steps that start a chunk of the elastic runs
    parameters: int
    elastic_step_median_s: float
    ddp_step_median_s: float
    step_ratio: float
    elastic_wall_per_step_s: float
    ddp_wall_per_step_s: float
    wall_ratio: float
    elastic: Breakdown
    ddp: Breakdown
    algorithm: str
    overlap: bool
    # One (elastic, DDP) pair per round, run alternately; the fields above are medians over
    # the rounds (the ratios: the median of the per-round ratios).
    rounds: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _ddp_worker(rank: int, world: int, store_path: str, model_name: str, batch: int, steps: int,
                out_path: str) -> None:
    """One DDP rank: `steps` steps, timed by phase; rank 0 writes one row per step (the
    slowest rank's, as `breakdown` takes them) to `out_path` as JSON."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(make_model(model_name))
    optimizer = _optimizer(model.parameters())
    x, y = make_dataset(model_name).tensors
    share = batch // world
    per_epoch = SAMPLES // batch
    rows = []
    perm = torch.empty(0, dtype=torch.long)
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        wall_start, started = time.time(), time.perf_counter()
        if s == 0:
            perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
        idx = perm[s * batch + rank * share : s * batch + (rank + 1) * share]
        xb, yb = x[idx], y[idx]
        loaded = time.perf_counter()
        _ddp_loss(model_name, model(xb), yb).backward()  # DDP's allreduce finishes in here
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ended = time.perf_counter()
        rows.append({"step": step, "start": wall_start, "time": time.time(),
                     "step_time_s": ended - started, "data_s": loaded - started,
                     "forward_backward_s": backward - loaded, "comm_s": 0.0,
                     "optimizer_s": ended - backward})
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        slowest = []
        for per_rank in zip(*gathered, strict=True):
            row = dict(max(per_rank, key=lambda r: r["step_time_s"]))
            row["start"] = max(r["start"] for r in per_rank)
            row["time"] = max(r["time"] for r in per_rank)
            slowest.append(row)
        with open(out_path, "w") as f:
            json.dump(slowest, f)
    leave_ddp(out_path, rank)


def _ddp_run(workers: int, model: str, global_batch_size: int, steps: int) -> list[dict]:
    """The DDP loop's rows, one per step (see `_ddp_worker`)."""
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        out = os.path.join(directory, "ddp.json")
        run_ddp(_ddp_worker, (workers, store, model, global_batch_size, steps, out), workers, out)
        with open(out) as f:
            return json.load(f)


def run_overhead_bench(workers: int = 2, model: str = "mlp", steps: int = 40,
                       global_batch_size: int = 256, warmup: int = 8,
                       algorithm: str = CollectiveConfig().algorithm,
                       overlap: bool | None = None, rounds: int = 1,
                       steps_per_chunk: int = FitConfig.model_fields["steps_per_chunk"].default,
                       ) -> OverheadResult:
    """Trains `model` for `steps` steps with `elastic.fit` (in chunks of `steps_per_chunk`
    steps, the run's default unless given) and with DDP, `rounds` times alternately (so that
    drift of the shared machine hits both alike); medians leave out the first `warmup` steps of
    each run.

    Raises:
        ValueError: an unknown model, or sizes that do not fit.
    """
    if model not in MODELS:
        raise ValueError(f"--model must be among {', '.join(MODELS)}, got {model!r}")
    if workers < 1 or warmup < 1 or steps <= warmup + 2:
        raise ValueError(f"need at least 1 worker and more than {warmup + 2} steps")
    if global_batch_size % workers:
        raise ValueError("--batch must be divisible by --workers (DDP takes even shares)")
    if not 1 <= global_batch_size <= SAMPLES:
        raise ValueError(f"--batch must be between 1 and the data set's {SAMPLES} samples, got "
                         f"{global_batch_size}")
    if rounds < 1 or steps_per_chunk < 1:
        raise ValueError(f"--rounds and --steps-per-chunk must be at least 1, got {rounds} and "
                         f"{steps_per_chunk}")
    starts = chunk_starts(steps, steps_per_chunk, SAMPLES // global_batch_size)
    job = make_job(model)
    collective = CollectiveConfig(algorithm=algorithm, overlap=overlap)  # type: ignore[arg-type]
    ours: list[Breakdown] = []
    theirs: list[Breakdown] = []
    for _ in range(rounds):
        config = FitConfig(
            scaling=ScalingConfig(num_workers=workers),
            batch=BatchConfig(global_batch_size=global_batch_size, autotune=False, rebalance=False),
            collective=collective, max_steps=steps, steps_per_chunk=steps_per_chunk, chunks_ahead=True,
            run_dir=tempfile.mkdtemp(prefix="elastic-bench-overhead-"),
        )
        ours.append(breakdown(elastic_rows(run_metrics(fit(job, config))), warmup, starts))
        theirs.append(breakdown(_ddp_run(workers, model, global_batch_size, steps), warmup))
    per_round = [{"elastic": asdict(e), "ddp": asdict(d), "step_ratio": e.step_s / d.step_s,
                  "wall_ratio": e.wall_s / d.wall_s} for e, d in zip(ours, theirs, strict=True)]
    elastic, ddp = median_breakdown(ours), median_breakdown(theirs)
    return OverheadResult(
        model=model, workers=workers, global_batch_size=global_batch_size, steps=steps,
        warmup=warmup, steps_per_chunk=steps_per_chunk,
        chunk_boundaries=[s for s in starts if s >= warmup],
        parameters=sum(p.numel() for p in make_model(model).parameters()),
        elastic_step_median_s=elastic.step_s, ddp_step_median_s=ddp.step_s,
        step_ratio=statistics.median(r["step_ratio"] for r in per_round),
        elastic_wall_per_step_s=elastic.wall_s, ddp_wall_per_step_s=ddp.wall_s,
        wall_ratio=statistics.median(r["wall_ratio"] for r in per_round),
        elastic=elastic, ddp=ddp, algorithm=algorithm, overlap=collective.overlap_enabled,
        rounds=per_round,
    )
