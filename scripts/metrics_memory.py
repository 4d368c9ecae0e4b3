"""Bytes the controller holds in memory per committed step's metrics record (`RunLog.metrics`,
which `FitResult.metrics` is taken from) at 64 workers: `python scripts/metrics_memory.py`."""

import random
import tempfile
import tracemalloc

from elastic.runlog import RunLog

W, N = 64, 20_000
log = RunLog(tempfile.mkdtemp())
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
for s in range(N):
    log.metric(step=s, epoch=0, loss=random.random(), world_size=W, global_batch_size=1024,
               shares=[16] * W, micro_batch=16, micro_batches=[16] * W, step_time_s=random.random(),
               compute_time_s=random.random(), samples_per_s=random.random(), lr=random.random(),
               generation=3, time=random.random() * 1e9, data_s=random.random(),
               forward_backward_s=random.random(), comm_s=random.random(),
               optimizer_s=random.random(), metrics={"acc": random.random()},
               grad_norm=random.random(), timeline=[[0.1] * 8] * W)
print(f"{(tracemalloc.get_traced_memory()[0] - before) / N:.0f} bytes per step in memory")
