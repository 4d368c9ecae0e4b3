"""A driver for `ray job submit`: trains the spirals job on the cluster the job runs on.

    RAY_AUTH_MODE=token ray job submit --address http://HEAD:8265 --no-wait \
        --working-dir examples -- python submit_job.py --name spirals --workers 2 --epochs 4

(as tests/fault/test_ray_job_submit.py submits it).

While it runs, from any machine connected to the cluster:
    elastic status spirals; elastic scale spirals 3; elastic kill spirals --rank 1
`elastic stop spirals` ends it after the step in flight; so does `ray job stop` (its SIGTERM),
which leaves the weights in the run dir's final_model.pt.
"""

from __future__ import annotations

import argparse

from spirals import job  # examples/ is on sys.path when run as a script

import elastic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default="spirals")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    config = elastic.FitConfig(
        name=args.name,
        scaling=elastic.ScalingConfig(num_workers=args.workers, min_workers=1,
                                      max_workers=args.max_workers),
        batch=elastic.BatchConfig(global_batch_size=64), epochs=args.epochs,
    )
    result = elastic.fit(job, config)
    ended = "stopped" if result.stopped else "finished"  # stopped: by `elastic stop`
    print(f"{ended} after {result.steps} steps; evaluation {result.evaluation}")


if __name__ == "__main__":
    main()
