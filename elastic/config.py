"""Configuration: one frozen pydantic model per concern.

Every field has a description; bad input fails at construction with one message that names
the setting to change. Durations are `timedelta`; unlimited is `None`. Environment overrides
are read here only, from the named constants below.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Backend = Literal["gloo", "nccl"]
Algorithm = Literal["ring", "tree", "halving_doubling", "native"]
ReduceOp = Literal["sum", "avg", "max"]

ALGORITHMS: tuple[Algorithm, ...] = ("ring", "tree", "halving_doubling", "native")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CollectiveConfig(_Frozen):
    """How the workers talk to each other."""

    backend: Backend = Field(
        default="gloo",
        description="Communication backend: 'gloo' (CPU tensors) or 'nccl' (CUDA tensors, "
        "needs the `gpu` extra).",
    )
    algorithm: Algorithm = Field(
        default="ring",
        description="Allreduce algorithm: 'ring' (bandwidth-optimal, any world size), 'tree' "
        "(binomial reduce + broadcast), 'halving_doubling' (Rabenseifner), or 'native' (the "
        "backend's own).",
    )
    timeout: timedelta = Field(
        default=timedelta(minutes=5),
        gt=timedelta(0),
        description="Longest a single collective may take before it fails with "
        "CollectiveTimeoutError. Failures are normally detected long before this.",
    )
    rendezvous_timeout: timedelta = Field(
        default=timedelta(seconds=60),
        gt=timedelta(0),
        description="Longest the ranks of a new generation wait for each other to connect.",
    )
    segment_bytes: int = Field(
        default=16 << 20,
        ge=1024,
        description="Pipelining granularity of the ring algorithm in bytes: each ring step is "
        "sent in segments of this size so that reduction overlaps transfer. Smaller segments "
        "overlap more but cost a thread hand-off each; 16 MiB measured best on a 2-core host.",
    )
