"""Benchmarks behind `elastic bench ...`: each returns a result the CLI prints and saves."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The benchmarks' loss: cross-entropy of `model(inputs)` against integer labels."""
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def sgd(params, lr: float = 0.01, momentum: float = 0.0) -> torch.optim.Optimizer:
    """The benchmarks' optimizer (bind `lr`/`momentum` with functools.partial)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def leave_ddp(out: str, rank: int) -> None:
    """The end of a DDP baseline rank (`run_ddp`): both ranks leave together (a rank tearing
    its connections down while another still works made gloo abort that one), and say that
    their work is over before they tear down."""
    dist.barrier()
    pathlib.Path(f"{out}.done{rank}").touch()
    dist.destroy_process_group()


def run_ddp(worker: Callable[..., None], args: tuple[Any, ...], workers: int, out: str) -> None:
    """Runs `worker(rank, *args)` in `workers` spawned processes, each ending with
    `leave_ddp(out, rank)`. Gloo can still abort a rank (SIGABRT) while the ranks tear their
    connections down after the barrier (seen twice in CI): once every rank's work is over, the
    results in `out` stand; a rank that died before that fails the benchmark."""
    processes = mp.start_processes(worker, args=args, nprocs=workers, join=False,
                                   start_method="spawn")
    try:
        while not processes.join():
            pass
    except mp.ProcessExitedException:
        if not all(os.path.exists(f"{out}.done{rank}") for rank in range(workers)):
            raise
