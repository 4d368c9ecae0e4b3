"""A sharded job: a data set stored as parquet files, read a row group at a time in the public
shard order (`elastic.data`), so that no worker holds the whole data set:

    elastic run examples/parquet_shards.py:job --workers 2 --epochs 2 --ledger

`job()` first writes 8 parquet files of a synthetic regression task
(`ELASTIC_EXAMPLE_SHARDS`, default a folder in the temporary directory). `ParquetSource` takes
local paths, globs and fsspec URLs (`s3://bucket/train/*.parquet` with s3fs installed).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
from torch import nn

from elastic import TrainJob
from elastic.data import ParquetSource

FEATURES = 16
SHARDS = 8
ROWS = 512


def write_shards(root: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    weights = rng.normal(size=FEATURES)
    for k in range(SHARDS):
        path = os.path.join(root, f"part-{k:03d}.parquet")
        if os.path.exists(path):
            continue
        n = ROWS + 37 * k  # shards of different sizes
        x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        y = x @ weights + 0.1 * rng.normal(size=n)
        partial = f"{path}.{os.getpid()}.tmp"
        pq.write_table(pa.table({"x": list(x), "y": y.astype(np.float32)}), partial,
                       row_group_size=128)
        os.replace(partial, path)


def to_sample(row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(row["x"], dtype=torch.float32), torch.tensor([row["y"]], dtype=torch.float32)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))


def loss(m: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(m(x), y)


def job() -> TrainJob:
    root = os.environ.get("ELASTIC_EXAMPLE_SHARDS",
                          os.path.join(tempfile.gettempdir(), f"elastic-example-shards-{os.getuid()}"))
    write_shards(root)
    return TrainJob(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                    loss=loss, dataset=lambda: ParquetSource(root, transform=to_sample))
