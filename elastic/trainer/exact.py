"""Exact mode (`batch.exact`): sums over a step's groups whose bits do not depend on where each
group ran, so a run ends with the very same weights for any shares, world size and failure
schedule, and as a single process running the groups in order.

What a step sums over its groups is a list of *slots*: the gradient of each parameter, the loss,
the `LossSum` count, and each BatchNorm layer's running-statistic terms. Every slot t has an
exponent e_t, part of the committed state. One group's value x of slot t (a float tensor) is
rounded to integers

    q = round(float64(x) * 2**-e_t)            (ties to even)

which are summed exactly: on the rank over its groups, then by the allreduce. The integers
travel as float64, whose sums of integers are exact while every partial sum stays below 2**53:
with n groups in a step a group's integers stay below 2**bits, `bits = 52 - max(1, ceil(log2
n))`, so that n of them sum below 2**52. Exact integer addition does not depend on the order, so the
step's sum, `(sum q) * 2**e_t` (float64) cast to the slot's dtype, is the same bits wherever
the groups ran.

Exponents (public, so that a plain loop can replay a run; `tests/fidelity.py` does):

- at the start, e_t = HEADROOM - bits: values below 2**HEADROOM fit;
- after every applied step, with S_t the sum over the step's groups of max |q| (summed
  exactly): if S_t > 0, e_t += bitlen(S_t) + HEADROOM - bits, so the next step fits values up
  to 2**HEADROOM times S_t (at least this step's largest value, at most n times it), at a
  resolution of 2**-(bits - HEADROOM) of that bound (for 64 groups at least 2**-32 of the
  largest value: finer than float32 for values near it; values below the resolution round
  to 0);
- a group whose max |q| reaches 2**bits cannot be summed: it adds 2**c_t to slot t's overflow
  (c_t = min(frexp exponent of its max |q| - bits, bits)); a rank with such a group votes to
  redo the step, every rank sets e_t += bitlen(summed overflow) - 1 and runs the step again
  (the overflow is a sum over groups too, so the redo does not depend on the split either).

Only an applied step moves the exponents for good: a step that is voted down, fails in its
reduce or is skipped (non-finite values under the policy 'skip') leaves them as they were at
its start, rescales included (`Replica.run_step` restores them).
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from typing import Any

import torch

HEADROOM = 8
# Exponents stay where 2.0 ** -e is a finite float64.
_LOWEST, _HIGHEST = -1000, 1000


def value_bits(groups: int) -> int:
    """How many bits one group's integers may use in a step of `groups` groups."""
    return 52 - max(1, (groups - 1).bit_length())


def initial_exponent(groups: int) -> int:
    """Every slot's exponent at the start of a run."""
    return HEADROOM - value_bits(groups)


def next_exponent(exponent: int, max_sum: int, groups: int) -> int:
    """A slot's exponent after an applied step whose groups' max |q| sum to `max_sum`."""
    if max_sum <= 0:
        return exponent
    return _clamp(exponent + max_sum.bit_length() + HEADROOM - value_bits(groups))


def overflow_bits(max_q: float, groups: int) -> int:
    """c for a group whose largest |q| is `max_q` (at least 2**bits)."""
    bits = value_bits(groups)
    return min(math.frexp(max_q)[1] - bits, bits)


def rescaled_exponent(exponent: int, overflow: int) -> int:
    """A slot's exponent for the redo of a step whose groups' 2**c sum to `overflow`."""
    return _clamp(exponent + overflow.bit_length() - 1) if overflow > 0 else exponent


def _clamp(exponent: int) -> int:
    return max(_LOWEST, min(_HIGHEST, exponent))


def fused_on(device: torch.device) -> bool:
    """Whether the exact sums of values on `device` are made the GPU's way (`ExactSum.add_many`):
    the largest magnitudes of a group's values read in one go, the values rounded and summed on
    the device, the sums copied to the host once per step. On the CPU each value is read,
    rounded and summed on its own, while it is still in cache: the GPU's way made a step of two
    CPU workers 1.3x slower (`elastic bench exact`, MLP). Tests run the GPU's way on the CPU by
    replacing this function."""
    return device.type != "cpu"


def _peak_cpu(x: torch.Tensor) -> float:
    """`x`'s largest magnitude (NaN where it holds a NaN), from `aminmax` (one pass: on the CPU
    25x faster than `_foreach_norm`)."""
    low, high = torch.stack(torch.aminmax(x)).tolist()
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def _peaks_fused(xs: Sequence[torch.Tensor]) -> list[float]:
    """Each tensor's largest magnitude (NaN where it holds a NaN), for tensors on one device:
    one fused reduction per dtype (`_foreach_norm` of order inf, which propagates NaN, on a
    GPU too), a few kernels where one per tensor would be hundreds, and one read."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(xs):
        by_dtype.setdefault(x.dtype, []).append(i)
    peaks = torch.cat([torch.stack(torch._foreach_norm([xs[i] for i in group], ord=math.inf))
                       .to(torch.float64) for group in by_dtype.values()]).tolist()
    out = [0.0] * len(xs)
    for i, peak in zip([i for group in by_dtype.values() for i in group], peaks, strict=True):
        out[i] = peak
    return out


def environment() -> dict[str, Any]:
    """What exactness assumes of this process: the same group on the same inputs gives the same
    bits only with the same torch build, intra-op threads, CPU features and device (and, on a
    GPU, CUDA and cuDNN versions and the precision settings of `_gpu_precision`)."""
    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name(torch.cuda.current_device()) if gpu else "cpu"
    found = {"torch": str(torch.__version__), "threads": torch.get_num_threads(),
             "cpu": str(torch.backends.cpu.get_cpu_capability()), "machine": platform.machine(),
             "device": device}
    if gpu:  # the GPU's kernels come with CUDA and cuDNN, and their precision settings
        found.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                     **_gpu_precision())
    return found


def _gpu_precision() -> dict[str, Any]:
    """The settings that change a GPU's bits for the same inputs: TF32 for float32 matrix
    products, convolutions and RNNs (the flags of old, and since torch 2.9 per operation),
    reduced-precision reductions in half-precision products, and cuBLAS's workspace (which
    fixes its reduction splits)."""
    backends = torch.backends

    def read(get: Any) -> Any:
        try:
            return get()
        except RuntimeError:  # torch refuses an old flag that the new ones made ambiguous
            return "mixed"

    found = {
        "tf32_matmul": read(lambda: bool(backends.cuda.matmul.allow_tf32)),
        "tf32_cudnn": read(lambda: bool(backends.cudnn.allow_tf32)),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "bf16_reduced_reduction": bool(backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "fp16_reduced_reduction": bool(backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    if hasattr(backends.cuda.matmul, "fp32_precision"):  # torch 2.9 and later
        found.update(fp32_matmul=read(lambda: backends.cuda.matmul.fp32_precision),
                     fp32_conv=read(lambda: backends.cudnn.conv.fp32_precision),
                     fp32_rnn=read(lambda: backends.cudnn.rnn.fp32_precision))
    return found


def environment_changes(saved: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """What differs between the `environment()` a state was written under (`saved`) and this
    process's: key -> (then, now)."""
    here = environment()
    return {k: (saved.get(k), v) for k, v in here.items() if saved.get(k) != v}


def make_deterministic(threads: int) -> None:
    """Fixes this process's torch for exact mode: `threads` intra-op threads and deterministic
    kernels wherever the backend has a choice (an operation without one raises, naming it);
    on a GPU, cuDNN picks its algorithms without timing them (a choice by timing may differ
    between processes, and with it the bits)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA's first GEMM
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


class ExactSum:
    """The exact sums of one replica's steps.

    Per attempt of a step: `begin`, `add` for every group's value of every slot, `payload` (this
    rank's integers and the step's metadata in one float64 buffer, summed over ranks by one
    allreduce), `finish` with the summed buffer, `value` per slot; then `advance` (applied),
    `rescale` (a redo) or nothing (voted down or skipped).

    Args:
        sizes: the number of elements of each slot.
        groups: groups per step (the global batch over the group size).
    """

    def __init__(self, sizes: Sequence[int], groups: int) -> None:
        self.sizes = list(sizes)
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.groups = groups
        self.bits = value_bits(groups)
        self._limit = float(1 << self.bits)
        self.exponents = [initial_exponent(groups)] * len(self.sizes)
        self.nonfinite = False
        self.overflowed = False
        self._buffer = torch.zeros(0, dtype=torch.float64)
        # This attempt's sums of the values added on each device but the CPU (whose go into
        # the host buffer), added into the host buffer by `payload`.
        self._sums: dict[torch.device, torch.Tensor] = {}
        self._scratch = torch.empty(max(self.sizes, default=0), dtype=torch.float32)
        self._max_sums = [0] * len(self.sizes)
        self.added: set[int] = set()  # the slots a value was added to in this step's attempt
        self._overflow = [0] * len(self.sizes)
        self._summed: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return len(self.sizes)

    @property
    def payload_length(self) -> int:
        """Integers this rank sends per step before the metadata: the values, then per slot the
        sum of max |q| and the overflow."""
        return self.offsets[-1] + 2 * self.slots

    def begin(self, extra: int = 0) -> None:
        """Before the compute of one attempt of a step whose metadata has `extra` values."""
        length = self.payload_length + extra
        if self._buffer.numel() != length:
            self._buffer = torch.zeros(length, dtype=torch.float64)
        else:
            self._buffer[: self.offsets[-1]].zero_()
        for sums in self._sums.values():
            sums.zero_()
        self._max_sums = [0] * self.slots
        self._overflow = [0] * self.slots
        self.nonfinite = self.overflowed = False
        self._summed = None
        self.added = set()

    def add(self, slot: int, value: torch.Tensor) -> None:
        """Adds one group's `value` of `slot` (any float tensor of the slot's size; on any
        device). A non-finite value sets `nonfinite`; one too large for the slot's exponent
        sets `overflowed` and is left out."""
        self.add_many([(slot, value)])

    def add_many(self, values: Sequence[tuple[int, torch.Tensor]]) -> None:
        """`add` for one group's value of each of several slots (`(slot, value)` pairs). On a
        GPU (`fused_on`) the values' largest magnitudes are read with one copy to the host per
        device (where a value at a time would wait for the device per slot), and each value
        is rounded and summed there: the group sums stay on the device until `payload` copies
        them to the host, once per step. On the CPU each value is read and summed on its own.
        The arithmetic is the same on every device (a power-of-two scaling, rounding ties to
        even, sums of integers below 2**53)."""
        fused: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for slot, value in values:
            x = value.detach().reshape(-1)
            if x.numel() != self.sizes[slot]:
                raise ValueError(f"slot {slot} holds {self.sizes[slot]} values, got {x.numel()}")
            self.added.add(slot)
            if x.numel() == 0:
                continue
            if x.dtype not in (torch.float32, torch.float64):
                x = x.float()  # 16-bit floats: scaled values could overflow their range
            if fused_on(x.device):
                fused.setdefault(x.device, []).append((slot, x))
            else:
                self._add_one(slot, x, _peak_cpu(x))
        for pending in fused.values():
            for (slot, x), largest in zip(pending, _peaks_fused([x for _, x in pending]),
                                          strict=True):
                self._add_one(slot, x, largest)

    def fused(self, device: torch.device) -> bool:
        """Whether values on `device` are summed the GPU's way (`fused_on`)."""
        return fused_on(device)

    def _add_one(self, slot: int, x: torch.Tensor, largest: float) -> None:
        """`x` (flat, float32 or float64) into `slot`, its largest magnitude `largest` read."""
        if not math.isfinite(largest):
            self.nonfinite = True
            return
        exponent = self.exponents[slot]
        try:
            max_q = round(math.ldexp(largest, -exponent))  # ties to even, like torch.round
        except OverflowError:  # beyond float64: as wide a rescale as one redo may take
            max_q = math.inf
        if max_q >= self._limit:
            self.overflowed = True
            bits = self.bits if max_q == math.inf else overflow_bits(float(max_q), self.groups)
            self._overflow[slot] += 1 << bits
            return
        if max_q == 0:
            return
        self._accumulate(slot, x, exponent)
        self._max_sums[slot] += int(max_q)

    def _accumulate(self, slot: int, x: torch.Tensor, exponent: int) -> None:
        """`round(x * 2**-exponent)` into `slot`'s sums on `x`'s device."""
        if not fused_on(x.device):
            sums = self._buffer[: self.offsets[-1]]
        else:
            sums = self._sums.get(x.device)
            if sums is None:
                sums = self._sums[x.device] = torch.zeros(self.offsets[-1], dtype=torch.float64,
                                                          device=x.device)
        if x.dtype == torch.float32 and -127 <= exponent <= 126:
            # A power-of-two scaling is exact in x's own dtype (a value it pushes below the
            # normal range rounds to 0 either way), so this equals the float64 rule. On the
            # CPU into a scratch kept from call to call; on a GPU a temporary, which the
            # caching allocator keeps safe for whatever stream reads it.
            if x.device.type == "cpu":
                q = torch.mul(x, 2.0 ** -exponent, out=self._scratch[: x.numel()])
            else:
                q = x * (2.0 ** -exponent)
        else:  # 2**-exponent is not a float32
            q = x.to(torch.float64) * (2.0 ** -exponent)
        q.round_()
        sums[self.offsets[slot] : self.offsets[slot + 1]].add_(q)

    def payload(self, zero: bool, meta: torch.Tensor | None = None,
                keep: Sequence[int] = ()) -> torch.Tensor:
        """This rank's buffer for the allreduce, with `meta` (float64, of the `extra` length
        `begin` was given) at its end; values and sums zeroed when `zero` (the rank voted the
        step down) except the slots in `keep`; the overflow always kept."""
        end = self.offsets[-1]
        for sums in self._sums.values():  # the sums made on a device join the host's (exact:
            if zero:                      # integers below 2**53), once; the kept slots' only
                for k in keep:            # when the rest is zeroed
                    span = slice(self.offsets[k], self.offsets[k + 1])
                    self._buffer[span].add_(sums[span].cpu())
            else:
                self._buffer[:end].add_(sums.cpu())
            sums.zero_()
        if zero:
            kept = {k: self._buffer[self.offsets[k] : self.offsets[k + 1]].clone() for k in keep}
            self._buffer[:end].zero_()
            for k, values in kept.items():
                self._buffer[self.offsets[k] : self.offsets[k + 1]].copy_(values)
        tail = self._buffer[end : end + 2 * self.slots]
        tail.copy_(torch.tensor(([0] * self.slots if zero else self._max_sums) + self._overflow,
                                dtype=torch.float64))
        rest = self._buffer[self.payload_length :]
        if (0 if meta is None else meta.numel()) != rest.numel():
            raise ValueError(f"metadata of {0 if meta is None else meta.numel()} values; begin() "
                             f"was told {rest.numel()}")
        if meta is not None:
            rest.copy_(meta)
        return self._buffer

    def finish(self, summed: torch.Tensor) -> None:
        """Takes the buffer summed over ranks (the payload part of it, or all of it)."""
        if summed.numel() < self.payload_length:
            raise ValueError(f"a summed payload of {summed.numel()} values; expected at least "
                             f"{self.payload_length}")
        self._summed = summed

    def value(self, slot: int) -> torch.Tensor:
        """The step's exact sum of `slot` over every group, float64 (flat)."""
        assert self._summed is not None, "finish() first"
        ints = self._summed[self.offsets[slot] : self.offsets[slot + 1]]
        return ints * (2.0 ** self.exponents[slot])

    def values(self, slots: Sequence[int], device: torch.device) -> list[torch.Tensor]:
        """`value` of each of `slots` (consecutive or not), on `device`: the summed integers
        of the span from the first slot to the last copied there once, then scaled there in
        place (a power-of-two scaling: the same bits as on the host)."""
        assert self._summed is not None, "finish() first"
        slots = list(slots)
        if not slots:
            return []
        assert len(set(slots)) == len(slots), f"slots named twice: {slots}"  # scaled in place
        low, high = self.offsets[min(slots)], self.offsets[max(slots) + 1]
        span = self._summed[low:high]
        ints = span.to(device, copy=True)  # a copy of its own, on the host too
        out = []
        for k in slots:
            piece = ints[self.offsets[k] - low : self.offsets[k + 1] - low]
            out.append(piece.mul_(2.0 ** self.exponents[k]))
        return out

    def scalar(self, slot: int) -> float:
        return float(self.value(slot)[0])

    def _tail(self, k: int) -> list[int]:
        assert self._summed is not None, "finish() first"
        start = self.offsets[-1] + k * self.slots
        return [int(v) for v in self._summed[start : start + self.slots].tolist()]

    def advance(self) -> None:
        """After an applied step: every exponent follows the step's largest values."""
        self.exponents = [next_exponent(e, s, self.groups)
                          for e, s in zip(self.exponents, self._tail(0), strict=True)]

    def rescale(self) -> None:
        """Before the redo of a step some group's values did not fit."""
        self.exponents = [rescaled_exponent(e, o)
                          for e, o in zip(self.exponents, self._tail(1), strict=True)]

    def state_dict(self) -> dict[str, Any]:
        return {"exponents": list(self.exponents), "groups": self.groups,
                "environment": environment()}

    def check_state(self, state: Any) -> None:
        """Raises ValueError, naming what differs, if `state` (from a peer or a checkpoint) is
        malformed or not for this model and batch."""
        exponents = state.get("exponents") if isinstance(state, dict) else None
        groups = state.get("groups") if isinstance(state, dict) else None
        if not (isinstance(exponents, list) and isinstance(groups, int)
                and all(isinstance(e, int) and _LOWEST <= e <= _HIGHEST for e in exponents)):
            raise ValueError("the exact-mode state is malformed (exponents must be integers in "
                             f"[{_LOWEST}, {_HIGHEST}], groups an integer)")
        slots = len(exponents)
        if slots != self.slots or groups != self.groups:
            raise ValueError(
                f"the exact-mode state has {slots} slots for {groups} groups per step; this "
                f"model and batch have {self.slots} for {self.groups} (a different model, or "
                "batch.global_batch_size / batch.group_size giving another number of groups: "
                "set batch.group_size to the run's)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.exponents = list(state["exponents"])
