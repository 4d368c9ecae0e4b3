"""`elastic bench exact`: what exact mode (`batch.exact`) costs, on the overhead benchmark's MLP
and CNN, against the default at the same world size, in one invocation.

Both runs forward the same groups of G = B / (largest world size) samples (the default with
`batch.max_micro_batch = G`), so the difference is only the sum: the default reduces float32
gradients (one allreduce after the backward pass); exact mode rounds each group's gradient to
integers at a power-of-two scale and reduces them (as float64, exact for integers). Reported
per (model, workers): the median in-step time of each (the slowest rank per step), their ratio,
the exposed communication, the bytes each rank puts into the allreduce per step, and whether
the exact runs at every world size ended with the same weight bits (they must).
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass, field

import torch

from elastic.api import fit
from elastic.bench import classification_loss
from elastic.bench.overhead import CLASSIFIERS, _optimizer, make_dataset, make_model
from elastic.config import BatchConfig, FitConfig, ScalingConfig
from elastic.job import TrainJob
from elastic.trainer.exact import ExactSum


@dataclass
class ExactRow:
    model: str
    workers: int
    parameters: int
    default_step_median_s: float
    exact_step_median_s: float
    ratio: float
    default_comm_median_s: float
    exact_comm_median_s: float
    default_bytes_per_step: int
    exact_bytes_per_step: int
    rounds: list[dict] = field(default_factory=list)


@dataclass
class ExactBenchResult:
    global_batch_size: int
    group_size: int
    steps: int
    warmup: int
    rows: list[ExactRow]
    # model -> exact runs at every world size ended alike (None: one world size, nothing compared)
    bit_identical: dict[str, bool | None]

    def to_json(self) -> dict:
        return asdict(self)


def payload_bytes(model: torch.nn.Module, workers: int, exact: bool) -> int:
    """Bytes one rank puts into the step's allreduce: the default's float32 gradients and
    metadata (loss, votes, count, forms, buffer flags); exact mode's integers as float64
    (gradients, loss, count), per-slot sums and overflows, and the same metadata."""
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    meta = 3 + 2 * workers + 1  # no BatchNorm layers in these models
    if not exact:
        return (sum(sizes) + meta) * 4
    return (ExactSum([*sizes, 1, 1], groups=1).payload_length + meta) * 8


def run_exact_bench(models: list[str], workers: list[int], steps: int = 30,
                    global_batch_size: int = 256, warmup: int = 5,
                    rounds: int = 1) -> ExactBenchResult:
    """Trains each model at each world size, the default and exact mode alternately, `rounds`
    times; medians leave out the first `warmup` steps.

    Raises:
        ValueError: an unknown model, or sizes that do not fit.
    """
    for model in models:
        if model not in CLASSIFIERS:
            raise ValueError(f"--models must be among {', '.join(CLASSIFIERS)}, got {model!r}")
    if not workers or min(workers) < 1:
        raise ValueError("--workers needs world sizes of at least 1")
    if steps <= warmup + 1 or rounds < 1:
        raise ValueError(f"need more than {warmup + 1} steps and at least 1 round")
    group = global_batch_size // max(workers)
    if group < 1 or global_batch_size % max(workers):
        raise ValueError(f"--batch ({global_batch_size}) must be a multiple of the largest "
                         f"--workers ({max(workers)}): both modes run groups of batch / workers")
    rows, identical = [], {}
    for model in models:
        job = TrainJob(model=lambda m=model: make_model(m), optimizer=_optimizer,
                       loss=classification_loss, dataset=lambda m=model: make_dataset(m))
        finals = []
        for w in workers:
            per_round = []
            for _ in range(rounds):
                measured = {}
                for exact in (False, True):
                    batch = BatchConfig(global_batch_size=global_batch_size, autotune=False,
                                        rebalance=False, exact=exact, max_micro_batch=group,
                                        group_size=group)
                    config = FitConfig(scaling=ScalingConfig(num_workers=w), batch=batch,
                                       max_steps=steps, steps_per_chunk=steps,
                                       run_dir=tempfile.mkdtemp(prefix="elastic-bench-exact-"))
                    result = fit(job, config)
                    kept = [m for m in result.metrics if m["step"] >= warmup]
                    measured[exact] = (statistics.median(m["step_time_s"] for m in kept),
                                       statistics.median(m["comm_s"] for m in kept))
                    if exact and not per_round:
                        finals.append(result.model_state)
                per_round.append({"default_step_s": measured[False][0],
                                  "exact_step_s": measured[True][0],
                                  "ratio": measured[True][0] / measured[False][0],
                                  "default_comm_s": measured[False][1],
                                  "exact_comm_s": measured[True][1]})
            net = make_model(model)
            rows.append(ExactRow(
                model=model, workers=w, parameters=sum(p.numel() for p in net.parameters()),
                default_step_median_s=statistics.median(r["default_step_s"] for r in per_round),
                exact_step_median_s=statistics.median(r["exact_step_s"] for r in per_round),
                ratio=statistics.median(r["ratio"] for r in per_round),
                default_comm_median_s=statistics.median(r["default_comm_s"] for r in per_round),
                exact_comm_median_s=statistics.median(r["exact_comm_s"] for r in per_round),
                default_bytes_per_step=payload_bytes(net, w, exact=False),
                exact_bytes_per_step=payload_bytes(net, w, exact=True), rounds=per_round))
        identical[model] = None if len(finals) < 2 else all(
            state.keys() == finals[0].keys() and all(torch.equal(state[k], finals[0][k])
                                                     for k in state)
            for state in finals[1:])
    return ExactBenchResult(global_batch_size=global_batch_size, group_size=group, steps=steps,
                            warmup=warmup, rows=rows, bit_identical=identical)
