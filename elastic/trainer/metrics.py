"""User training metrics: what `TrainJob.loss` may return beside the loss, and how they ride
in the step's metadata.

`TrainJob.loss` may return `(loss, {name: value})`. A value is a scalar (a tensor or a number:
a mean over the micro-batch's samples, weighted by the micro-batch's length) or an
`elastic.LossSum(total, count)` (a sum over items and their number, such as correct tokens
out of the tokens that are not padding). Each metric is reported per committed step as its
weighted sum over the global batch divided by its weight, so it does not depend on how the
batch was split.

The metrics section of the step's metadata holds, after a flag, one (sum, weight) pair per
name in the order of `MetricNames.names`: every rank writes its own sums, and the step's
allreduce adds them. The names are the replica's committed state, the same on every rank when a
step begins; a rank whose metrics include a name it does not know raises the flag, and after
the allreduce every rank exchanges its new names (`merge_names`) and sums that step's values
again under the merged names. That happens once per new name, not per step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.errors import CollectiveError
from elastic.trainer.device import host_values, read_later
from elastic.trainer.loss import LossSum

# Bytes one rank may announce for its metric names (a peer cannot make a rank allocate more).
MAX_NAMES_BYTES = 1 << 16


def split_output(out: Any) -> tuple[Any, Mapping[str, Any] | None]:
    """The loss and the metrics of what `TrainJob.loss` returned: `loss` or `(loss, metrics)`.

    Raises:
        ValueError: a tuple that is not (loss, dict of str).
    """
    if not isinstance(out, tuple):
        return out, None
    if len(out) != 2 or not isinstance(out[1], Mapping):
        raise ValueError("TrainJob.loss returned a tuple; return a loss, or (loss, {name: value})")
    metrics = out[1]
    bad = [k for k in metrics if not isinstance(k, str) or not k]
    if bad:
        raise ValueError(f"TrainJob.loss returned metric names {bad!r}; names must be non-empty str")
    return out[0], metrics


def _checked(value: Any) -> float | torch.Tensor:
    """A metric's value as a float, or on a GPU as `read_later` keeps it, not read yet (a
    read waits for the device: `MetricSums` reads a step's values together).

    Raises:
        ValueError: a value that is not a number or a real tensor of one element.
    """
    if isinstance(value, torch.Tensor):
        return read_later(value, "a metric")
    if isinstance(value, (int, float)):
        return float(value)
    raise ValueError(f"a metric must be a number, a scalar tensor or a LossSum, got "
                     f"{type(value).__name__}")


@dataclass
class MetricSums:
    """One rank's metric sums over its micro-batches of a step.

    `add` checks each micro-batch's values at once (a bad one is that micro-batch's error) and
    keeps them unread; the step reads them with its losses (`unread`, then `settle` with what
    was read), or `section` reads them itself."""

    sums: dict[str, list[float]] = field(default_factory=dict)
    # (name, value, factor, weight) per micro-batch and metric: its sum is value * factor
    _terms: list[tuple[str, Any, float, Any]] = field(default_factory=list, init=False,
                                                      repr=False, compare=False)

    def add(self, metrics: Mapping[str, Any], samples: int) -> None:
        """One micro-batch's metrics over its `samples` samples: a scalar weighted by
        `samples`, or a `LossSum` as its total and count.

        Raises:
            ValueError: a value that is not a scalar or a `LossSum` of scalars.
        """
        for name, value in metrics.items():
            if isinstance(value, LossSum):
                self._terms.append((name, _checked(value.total), 1.0, _checked(value.count)))
            else:
                self._terms.append((name, _checked(value), float(samples), float(samples)))

    def unread(self) -> list[Any]:
        """The values `settle` needs, in its order (floats, and tensors not read yet)."""
        return [x for _, value, _, weight in self._terms for x in (value, weight)]

    def settle(self, read: Sequence[float] | None = None,
               known: Sequence[str] | None = None) -> None:
        """Adds the kept values into `sums`, in the order they came: `read` is `unread()` as
        floats (None: read here); then, given the step's `known` names, `check_names`.

        Raises:
            ValueError: too many metric names (`check_names`).
        """
        if known is not None:
            self.settle(read)
            self.check_names(known)
            return
        if not self._terms:
            return
        values = host_values(self.unread()) if read is None else list(read)
        assert len(values) == 2 * len(self._terms), "settle takes what unread gave"
        for i, (name, _, factor, _) in enumerate(self._terms):
            pair = self.sums.setdefault(name, [0.0, 0.0])
            pair[0] += values[2 * i] * factor
            pair[1] += values[2 * i + 1]
        self._terms.clear()

    def discard(self) -> None:
        """Drops everything, the values kept since the last `settle` unread (a failed
        attempt's: nothing of it is summed, and its names are not offered to the peers)."""
        self._terms.clear()
        self.sums.clear()

    def check_names(self, known: Sequence[str]) -> None:
        """Refuses, as the user's error, names this rank would ask its peers to adopt beside
        the `known` ones that exceed what they exchange (`MAX_NAMES_BYTES`: `exchange_names`
        refuses them on every rank, and each redo of the step would fail alike). JSON only
        when some names are new.

        Raises:
            ValueError: too many (or too long) metric names.
        """
        names = {*known, *self.sums}
        if len(names) == len(known):  # none new
            return
        size = len(encode_names(list(names)))
        if size > MAX_NAMES_BYTES:
            raise ValueError(f"TrainJob.loss returned {len(names)} metric names, {size} bytes as "
                             f"JSON, more than the {MAX_NAMES_BYTES} allowed; return fewer (sum "
                             "per-class or per-layer values into a few)")

    def section(self, names: Sequence[str]) -> torch.Tensor:
        """The metadata's metrics section under `names`: the flag (1.0 when this rank has a
        name not in `names`), then (sum, weight) per name."""
        self.settle()
        known = set(names)
        flag = 1.0 if any(name not in known for name in self.sums) else 0.0
        values = [flag]
        for name in names:
            values += self.sums.get(name, [0.0, 0.0])
        return torch.tensor(values, dtype=torch.float64)


def section_length(names: Sequence[str]) -> int:
    return 1 + 2 * len(names)


def read_section(section: torch.Tensor, names: Sequence[str]) -> tuple[bool, dict[str, float]]:
    """Whether some rank raised the new-names flag, and each metric's value (sum / weight;
    metrics of weight 0 are left out) from the summed section."""
    values = section.tolist()
    metrics = {}
    for i, name in enumerate(names):
        total, weight = values[1 + 2 * i], values[2 + 2 * i]
        if weight > 0:
            metrics[name] = total / weight
    return values[0] > 0, metrics


def encode_names(names: Sequence[str]) -> bytes:
    return json.dumps(sorted(names)).encode()


def decode_names(data: bytes) -> list[str]:
    """A peer's names; anything but a JSON list of strings is refused.

    Raises:
        ValueError: malformed names.
    """
    names = json.loads(data.decode())
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ValueError("a peer announced malformed metric names")
    return names


def merge_names(known: Sequence[str], *others: Sequence[str]) -> tuple[str, ...]:
    """The sorted union of the names."""
    merged = set(known)
    for names in others:
        merged.update(names)
    return tuple(sorted(merged))


def exchange_names(comm: Any, mine: list[str], committed: Sequence[str]) -> tuple[str, ...]:
    """When some rank's metrics named a metric the step's layout did not have (the summed
    flag), every rank calls this with its control plane `comm` and its own names `mine`:
    each broadcasts its names in turn, and all adopt the union with the `committed` names
    (`merge_names`). Every rank runs the same collectives (the flag is summed), so nobody is
    left waiting.

    Raises:
        CollectiveError: the exchange failed, or a peer announced malformed names (or more
            than `MAX_NAMES_BYTES`: refused before allocating them).
    """
    encoded = encode_names(mine)
    names: list[list[str]] = []
    for src in range(comm.world_size):
        size = torch.tensor([len(encoded) if src == comm.rank else 0], dtype=torch.int64)
        comm.broadcast(size, src)
        announced = int(size.item())
        if not 0 < announced <= MAX_NAMES_BYTES:
            raise CollectiveError(f"rank {src} announced {announced} bytes of metric names; "
                                  f"at most {MAX_NAMES_BYTES} are accepted", rank=comm.rank)
        data = (torch.frombuffer(bytearray(encoded), dtype=torch.uint8) if src == comm.rank
                else torch.empty(announced, dtype=torch.uint8))
        comm.broadcast(data, src)
        try:
            names.append(decode_names(data.numpy().tobytes()))
        except ValueError as e:
            raise CollectiveError(f"rank {src}: {e}", rank=comm.rank) from None
    return merge_names(committed, *names)
