"""A replica's committed state: what is saved and handed to peers (model, optimizer,
scheduler, random generators, the data cursor, the training state, metric names, extra
state, exact mode's exponents), how it is loaded back (from a checkpoint or a peer, from host
memory onto the replica's device), and how a generation's ranks take one rank's state over the
control plane without a peer being able to make them allocate more than such a state can be.

The functions take the replica as a `StateHost`: the parts of it they read and set, declared
below, so that this module does not import the replica.
"""

from __future__ import annotations

import io
from typing import Any, Protocol

import torch

from elastic.config import FitConfig
from elastic.errors import CollectiveError, ConfigError
from elastic.trainer.data import Cursor, SampleOrder
from elastic.trainer.device import rng_state, set_rng_state, to_device_like
from elastic.trainer.exact import ExactSum, environment_changes
from elastic.trainer.training import Training, load_extra_state


class StateHost(Protocol):
    """What the committed state is made of, and read into, on a replica."""

    config: FitConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    device: torch.device
    order: SampleOrder
    cursor: Cursor
    training: Training
    metric_names: tuple[str, ...]
    extra: dict[str, Any]
    exact: ExactSum | None
    torn_at: int | None

    def check_committed(self) -> None: ...

    def state_bytes(self) -> bytes: ...

    def load_state_bytes(self, data: bytes) -> None: ...


def committed_state(host: StateHost) -> dict[str, Any]:
    """The committed state: model, optimizer, scheduler, RNG and the data cursor. The RNG
    is 'rng', the CPU generator, and on a GPU worker 'cuda_rng', its device's generator
    (`elastic.trainer.device.rng_state`). Tensors stay where they live (the device):
    `elastic.trainer.device.to_host` copies them out.

    Raises:
        HalfUpdatedError: the replica is half updated (`torn_at`): it holds no committed
            state to save or hand to a peer.
    """
    host.check_committed()
    return {
        "model": host.model.state_dict(),
        "optimizer": host.optimizer.state_dict(),
        "scheduler": host.scheduler.state_dict() if host.scheduler else None,
        **rng_state(host.device),
        "cursor": {"global_step": host.cursor.step, "epoch": host.cursor.epoch,
                   "offset": host.cursor.offset, "samples": host.cursor.samples},
        "training": host.training.state_dict(),
        "metric_names": list(host.metric_names),
        **({"extra": {name: obj.state_dict() for name, obj in host.extra.items()}}
           if host.extra else {}),
        **({"exact": host.exact.state_dict()} if host.exact is not None else {}),
    }


def load_committed(host: StateHost, state: dict[str, Any], origin: str = "checkpoint") -> None:
    """Takes a committed state (`origin`: 'checkpoint' or 'peer'), from host memory or any
    device: the model and optimizer copy it to their device (the optimizer casts its state to
    each parameter's). The CUDA generator is restored on a GPU worker only. The extra state
    objects get their tensors on the device (`_extra_on_device`).

    Raises:
        ConfigError: exact mode, and the state was written without it or under another torch
            build, thread count or hardware type (from a checkpoint, unless
            `checkpoint.allow_environment_change`; from a peer, always: the members of an
            exact run must compute alike).
    """
    if host.exact is not None:
        _check_exact(host, state.get("exact"), origin)
    host.model.load_state_dict(state["model"])
    host.optimizer.load_state_dict(state["optimizer"])
    if host.scheduler is not None and state.get("scheduler") is not None:
        host.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state, host.device)
    host.training.load_state_dict(state.get("training"))
    host.metric_names = tuple(state.get("metric_names") or ())
    load_extra_state(host.extra, _extra_on_device(host, state.get("extra")))
    host.cursor = Cursor.from_dict(state["cursor"], host.order.dataset_size,
                                   host.config.batch.global_batch_size)
    if host.exact is not None and state.get("exact") is not None:
        host.exact.load_state_dict(state["exact"])
    host.torn_at = None


def _extra_on_device(host: StateHost, saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """The extra state objects' saved states with their tensors where each object holds them
    now (`elastic.trainer.device.to_device_like`: its own `state_dict()` as the template), and
    any tensor it does not hold yet (an EMA allocated at its first update) on the replica's
    device; a CPU replica's as they are. A state loaded from a checkpoint or a peer is in host
    memory."""
    if not saved or host.device.type == "cpu":
        return saved
    moved = dict(saved)
    for name, obj in host.extra.items():
        if name in moved:
            moved[name] = to_device_like(moved[name], obj.state_dict(), host.device)
    return moved


def _check_exact(host: StateHost, saved: dict[str, Any] | None, origin: str) -> None:
    assert host.exact is not None
    if saved is not None:
        try:
            host.exact.check_state(saved)
        except ValueError as e:
            raise ConfigError(f"batch.exact: {e}") from None
    there = (saved or {}).get("environment") or {}
    changes = environment_changes(there)
    if not changes:
        return
    ckpt = host.config.checkpoint
    if origin == "checkpoint" and ckpt is not None and ckpt.allow_environment_change:
        return
    what = ("was written without batch.exact" if saved is None or not there else
            "was written under " + ", ".join(f"{k}={a!r}" for k, (a, _) in changes.items())
            + "; this worker has " + ", ".join(f"{k}={b!r}" for k, (_, b) in changes.items()))
    if origin == "peer":
        raise ConfigError(f"batch.exact: the state of a peer {what}; every worker of an "
                          "exact run needs the same torch build, threads and hardware type")
    raise ConfigError(f"batch.exact: the checkpoint {what}, so this run could not "
                      "reproduce it; set checkpoint.allow_environment_change=True to resume "
                      "anyway (exact from here on)")


def state_bytes(state: dict[str, Any]) -> bytes:
    """A committed state, serialised for a peer."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def state_from_bytes(data: bytes) -> dict[str, Any]:
    """A peer's serialised state, in host memory; `weights_only`: a peer's bytes are data,
    never code."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def sync_state(host: StateHost, comm: Any, src: int) -> None:
    """Every rank of the generation calls this with its control plane `comm`; afterwards all
    hold `src`'s state (sent as bytes over it).

    Raises:
        CollectiveError: the broadcast failed, or `src` announced more bytes than a state of
            this model, optimizer and extra state can be (refused before allocating them).
    """
    payload = host.state_bytes() if comm.rank == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    comm.broadcast(size, src)
    announced = int(size.item())
    if comm.rank != src:
        # Checked before a byte is allocated: a peer cannot make this rank exhaust memory.
        limit = max_state_bytes(host.model, host.optimizer, host.extra)
        if not 0 < announced <= limit:
            raise CollectiveError(
                f"rank {src} announced a committed state of {announced} bytes; this rank "
                f"expects at most {limit} for its model, optimizer and extra state; refused",
                rank=comm.rank)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if comm.rank == src
            else torch.empty(announced, dtype=torch.uint8))
    comm.broadcast(data, src)
    if comm.rank != src:
        host.load_state_bytes(data.numpy().tobytes())


# Per-parameter tensors an optimizer may keep that a fresh one has not created yet (Adam with
# amsgrad keeps three: exp_avg, exp_avg_sq, max_exp_avg_sq), and room for everything that is
# not a tensor of the model's size (cursor, RNG state, scheduler, pickling).
_OPTIMIZER_SLOTS = 3
_STATE_SLACK_BYTES = 16 << 20
# Each extra state object may hold this many copies of the model's state on the peer that
# sends it, whatever it holds here: an EMA allocated at its first update is empty on a fresh
# replica (two: an EMA of the weights and one of their squares, say).
_EXTRA_SLOTS = 2


def max_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any] | None = None) -> int:
    """An upper bound of the serialised committed state of a replica of `model`: its own
    parameters and buffers plus up to `_OPTIMIZER_SLOTS` tensors per parameter in the
    optimizer (or what the optimizer already holds, if more), per extra state object
    `_EXTRA_SLOTS` copies of the model's state (or what it holds here, if more), plus a fixed
    slack."""
    tensors = list(model.state_dict().values())
    model_bytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    held = sum(tensor_bytes(v) for st in optimizer.state.values() for v in st.values())
    extra_bytes = sum(max(tensor_bytes(obj.state_dict()), _EXTRA_SLOTS * model_bytes)
                      for obj in (extra or {}).values())
    return model_bytes + max(_OPTIMIZER_SLOTS * params, held) + extra_bytes + _STATE_SLACK_BYTES


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in `value` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):  # LBFGS keeps its history as lists of tensors
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):  # an extra state's state_dict
        return sum(tensor_bytes(v) for v in value.values())
    return 0
