"""`elastic bench memory`: what each worker holds with the optimizer state whole (stage 0),
sharded (stage 1), or sharded with the summed gradients (stage 2), and what a step costs.

A decoder-only transformer (GPT-like, about 55M parameters: 12 layers of width 512, a
vocabulary of 16384, an untied output layer) with AdamW, trained by `elastic.fit` on
`workers` workers for a few steps per stage. A probe in each worker (an extra state object)
measures, right before each optimizer step, the bytes the gradients hold (an optimizer step
pre-hook; every storage a gradient lives in, whole: a gradient that is a view of a flat buffer
keeps the whole buffer), and after it the optimizer-state bytes, the parameter bytes and the
process's peak resident memory. The median step time comes from the run's metrics (the first step, which
allocates the state, left out).
"""

from __future__ import annotations

import functools
import json
import os
import resource
import statistics
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from elastic.trainer.state import tensor_bytes

VOCAB, WIDTH, LAYERS, HEADS, SEQ = 16384, 512, 12, 8, 64


class GPT(nn.Module):
    """Token and position embeddings, pre-norm causal self-attention blocks, a final norm and
    an output layer of its own."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, layers: int = LAYERS,
                 heads: int = HEADS, seq: int = SEQ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.tokens(x) + self.positions(torch.arange(n, device=x.device))
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


class Tokens(Dataset):
    """Random token sequences (the bench measures memory and time, not learning)."""

    def __init__(self, count: int = 256, seq: int = SEQ) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, VOCAB, (count, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def next_token(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)


class MemoryProbe:
    """Extra state that measures its worker (see the module) and writes the newest figures to
    `folder/<pid>.json`; it holds no state of its own."""

    def __init__(self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.folder, self.optimizer = folder, optimizer
        self.grad_bytes = 0
        optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # The memory the gradients hold: each storage once, whole (a gradient that is a view
        # of a flat buffer or a bucket keeps all of it).
        storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                    for group in optimizer.param_groups for p in group["params"]
                    if p.grad is not None}
        self.grad_bytes = sum(storages.values())

    def after_step(self, model: nn.Module) -> None:
        figures = {
            "optimizer_state_bytes": sum(tensor_bytes(s) for s in self.optimizer.state.values()),
            "gradient_bytes": self.grad_bytes,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        path = os.path.join(self.folder, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(figures, f)
        os.replace(path + ".tmp", path)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return


def _probe(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"memory_probe": MemoryProbe(folder, model, optimizer)}


@dataclass
class MemoryResult:
    stage: int
    replicas: int
    workers: int
    parameters: int
    ranks: list[dict[str, int]] = field(default_factory=list)  # one per worker process
    median_step_s: float = 0.0

    def largest(self, key: str) -> int:
        return max(r[key] for r in self.ranks)


def run_memory(stages: list[int], workers: int = 4, replicas: int = 2, steps: int = 5,
               global_batch: int = 8) -> list[MemoryResult]:
    """One `elastic.fit` run per stage; see the module."""
    from elastic.api import fit
    from elastic.config import (
        BatchConfig,
        FitConfig,
        LoggingConfig,
        ScalingConfig,
        ShardingConfig,
    )
    from elastic.job import TrainJob

    parameters = sum(p.numel() for p in GPT().parameters())
    results = []
    for stage in stages:
        folder = tempfile.mkdtemp(prefix=f"bench-memory-{stage}-")
        job = TrainJob(model=GPT, optimizer=adamw, loss=next_token, dataset=Tokens,
                       extra_state=functools.partial(_probe, folder))
        config = FitConfig(scaling=ScalingConfig(num_workers=workers),
                           batch=BatchConfig(global_batch_size=global_batch, autotune=False,
                                             rebalance=False),
                           sharding=ShardingConfig(stage=stage,
                                                   replicas=replicas if stage else 2),
                           max_steps=steps, logging=LoggingConfig(progress="off"),
                           run_dir=os.path.join(folder, "run"))
        result = fit(job, config)
        ranks = []
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    ranks.append(json.load(f))
        times = [m["step_time_s"] for m in result.metrics[1:]] or [0.0]
        results.append(MemoryResult(stage, replicas if stage else 0, workers, parameters, ranks,
                                    statistics.median(times)))
    return results
