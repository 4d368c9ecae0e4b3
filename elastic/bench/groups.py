"""What one forward per group costs: step time of one rank on the scaling benchmark's CNNs
(BatchNorm) with the global batch cut into groups of G (a run started on B/G workers, now on
one) against one forward over the whole batch (groups off).

`python -m elastic.bench.groups [--model resnet50] [--batch 64] [--groups 64,32,16]`
prints one line per group size (median of `--steps` timed steps, best of two rounds).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

from elastic.adapt.plan import plan_batch
from elastic.bench import classification_loss, sgd
from elastic.bench.scaling import make_dataset, make_model
from elastic.collective import Communicator, RendezvousServer
from elastic.config import BatchConfig, FitConfig, ScalingConfig
from elastic.job import TrainJob
from elastic.trainer.replica import Replica


def measure(model: str, batch: int, groups: list[int], steps: int) -> dict[int, float]:
    """Seconds per step (best of two rounds of medians) for each group size."""
    job = TrainJob(model=functools.partial(make_model, model),
                   optimizer=functools.partial(sgd, momentum=0.9), loss=classification_loss,
                   dataset=functools.partial(make_dataset, model))
    config = FitConfig(scaling=ScalingConfig(num_workers=1), max_steps=1,
                       batch=BatchConfig(global_batch_size=batch, autotune=False, rebalance=False),
                       run_dir=tempfile.mkdtemp(prefix="elastic-bench-groups-"))
    server = RendezvousServer()
    comm = Communicator(0, 1, server.endpoint, 0, secret=server.secret)
    try:
        replica = Replica(job, config, config.run_dir)
        replica.comm = comm
        best: dict[int, float] = {}
        for _ in range(2):
            for g in groups:
                plan = plan_batch(batch, 1, g, None, unit=g)
                replica.run_step(plan, [])  # warm-up
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    replica.run_step(plan, [])
                    times.append(time.perf_counter() - start)
                best[g] = min(best.get(g, float("inf")), statistics.median(times))
        return best
    finally:
        comm.close()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--groups", default="64,32,16")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    result = measure(args.model, args.batch, groups, args.steps)
    whole = result.get(args.batch)
    for g, seconds in result.items():
        ratio = f" ({seconds / whole:.2f}x one forward)" if whole else ""
        print(f"{args.model} batch {args.batch} group {g}: {seconds * 1000:.1f} ms/step, "
              f"{args.batch // g} forwards{ratio}")


if __name__ == "__main__":
    main()
