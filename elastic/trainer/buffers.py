"""Buffers equal on every rank after every step, and BatchNorm running statistics that do not
depend on the split.

A step's forward passes (its pieces: one group of G samples each with groups on, else the
micro-batches) are numbered in the order of the global batch: rank 0's pieces first, then rank
1's, and so on. One process running them in that order would update a BatchNorm layer's
running statistic as

    b_n = P * b_0 + sum_k f_k * s_k * prod_{i > k} (1 - f_i),   P = prod_k (1 - f_k)

where s_k is piece k's batch statistic and f_k the layer's update factor (its momentum, or
1 / (batches tracked) when the momentum is None). The sum is linear in what each piece
contributes, so each rank adds up its own pieces' terms, the terms ride in the step's metadata
allreduce, and every rank writes the same b_n: exactly the sequential result (up to
floating-point summation order), for any shares, micro-batches and world size. Each piece's
term is read off the layer itself: its running statistics are zeroed before the forward, so
afterwards they hold `f_k * s_k`. A layer in eval mode (frozen) keeps its statistics through
the forward, which normalises with them, and adds no term.

Every other buffer (a user's own running average, a counter) cannot be reasoned about: when any
rank's forward changed one, the first rank with a share broadcasts them all (as DDP does), so
the members stay equal; their values then follow that rank's samples. A step voted down leaves
every buffer as it was before the step.

In exact mode (`attach`) each piece's terms go to the step's exact sums (`ExactSum`, one slot
per running statistic) instead of float64 sums, so the statistics are the same bits for any
split; a forward that changes any other buffer is a user error there (its value would follow
the split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from elastic.collective import Communicator
from elastic.trainer import device as _device
from elastic.trainer.exact import ExactSum


def norm_layers(model: torch.nn.Module) -> list[tuple[str, _BatchNorm]]:
    """The BatchNorm layers of `model` whose running statistics the step reduces."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and m.track_running_stats
            and m.running_mean is not None and m.running_var is not None
            and m.num_batches_tracked is not None]


@dataclass
class _Before:
    mean: torch.Tensor
    var: torch.Tensor
    tracked: int | None  # None: not read by the host (`BufferSync` on a GPU: on the device)


def _read_counts(counts: list[torch.Tensor]) -> list[int]:
    """Every layer's `num_batches_tracked` (`counts`: each as a one-element view), read in
    one copy from the device."""
    if not counts:
        return []
    if len({t.device for t in counts}) > 1:  # layers spread over devices: one read each
        return [int(t) for t in counts]
    return torch.cat(counts).tolist()


def _ran_again(name: str, calls: int) -> ValueError:
    return ValueError(
        f"BatchNorm layer {name!r} ran {calls} times in one forward pass; elastic keeps "
        "running statistics exact for layers that run once per forward. Give each use its own "
        "layer, or set track_running_stats=False on it")


class BufferSync:
    """The buffers of one replica's model across one step.

    Per step: `begin` (a snapshot), then around each forward `before_piece`/`after_piece`,
    `section` (this rank's part of the metadata), and `commit` with the summed section, or
    `rollback`.

    Args:
        model: the replica's model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.norms = norm_layers(model)
        covered = {id(t) for _, m in self.norms
                   for t in (m.running_mean, m.running_var, m.num_batches_tracked)}
        self.others = [(name, b) for name, b in model.named_buffers() if id(b) not in covered]
        self._stats = sum(m.running_mean.numel() + m.running_var.numel() for _, m in self.norms)
        # Every layer's running mean and variance, in the section's order. When they share one
        # device, they are handled as a whole (foreach and flat tensors: a few kernels per
        # step on a GPU, where one per layer would be hundreds).
        self._stat_tensors = [t for _, m in self.norms for t in (m.running_mean, m.running_var)]
        self._counts = [m.num_batches_tracked for _, m in self.norms]
        self._count_views = [t.detach().reshape(1) for t in self._counts]
        self._whole = (len({(t.device, t.dtype) for t in self._stat_tensors}) == 1
                       and len({(t.device, t.dtype) for t in self._counts}) == 1
                       and self._counts[0].device == self._stat_tensors[0].device)
        self._flat_sums: torch.Tensor | None = None
        # As a whole: the statistics at `begin` (flat; `_before` holds views of it) and the
        # layers' `num_batches_tracked` then (on their device).
        self._stat_flat = [t.detach().reshape(-1) for t in self._stat_tensors]
        self._flat_before: torch.Tensor | None = None
        self._before_views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._tracked: torch.Tensor | None = None
        self._before: list[_Before] = []
        self._others_before: list[torch.Tensor] = []
        self._sums: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ran: list[bool] = []
        # On a GPU (`_deferred`): each forward pass's calls per layer, on the device, checked
        # in the step's one read (`unread`, `settle`) instead of read after each forward; and
        # the step's as one tensor (forward passes x layers), once asked for.
        self._deferred = False
        self._calls: list[torch.Tensor] = []
        self._stacked: torch.Tensor | None = None
        self._training: list[bool] = []  # which layers the last `before_piece` zeroed
        self._pieces = 0
        self._exact: ExactSum | None = None
        self._slot = 0

    def attach(self, exact: ExactSum, first_slot: int) -> None:
        """Exact mode: layer i's running mean and variance terms go to slots `first_slot + 2i`
        and `first_slot + 2i + 1` of `exact`."""
        self._exact, self._slot = exact, first_slot

    def slot_sizes(self) -> list[int]:
        """The sizes of the exact slots `attach` expects, in order."""
        return [n for _, m in self.norms for n in (m.running_mean.numel(), m.running_var.numel())]

    @property
    def length(self) -> int:
        """Length of the metadata section: one changed flag, one ran flag per BatchNorm layer,
        then the running-statistic terms (in exact mode, in the exact sums instead)."""
        return 1 + len(self.norms) + (0 if self._exact is not None else self._stats)

    def begin(self, pieces: int) -> None:
        """Snapshot before a step of `pieces` forward passes over all ranks."""
        self._pieces = pieces
        self._refresh_views()
        self._calls, self._stacked = [], None
        self._deferred = self._defers()
        if self._deferred:  # the counters stay on the device: nothing here waits for it
            self._begin_whole([None] * len(self.norms))
        elif self._whole:
            self._begin_whole(_read_counts(self._count_views))  # one read for every layer
        else:
            tracked = _read_counts(self._count_views)
            self._before = [_Before(m.running_mean.detach().clone(),
                                    m.running_var.detach().clone(), n)
                            for (_, m), n in zip(self.norms, tracked, strict=True)]
            self._sums = [(torch.zeros_like(m.running_mean, dtype=torch.float64),
                           torch.zeros_like(m.running_var, dtype=torch.float64))
                          for _, m in self.norms]
        self._others_before = [b.detach().clone() for _, b in self.others]
        self._ran = [False] * len(self.norms)

    def _refresh_views(self) -> None:
        """The flat views of the statistics and counters made again if a buffer's storage
        was swapped (`bn.running_mean.data = ...`); a pointer comparison per tensor, no
        kernel."""
        if any(v.data_ptr() != t.data_ptr() for v, t in zip(
                self._stat_flat + self._count_views, self._stat_tensors + self._counts,
                strict=True)):
            self._stat_flat = [t.detach().reshape(-1) for t in self._stat_tensors]
            self._count_views = [t.detach().reshape(1) for t in self._counts]

    def _defers(self) -> bool:
        """Whether this step leaves the BatchNorm counters on the device (`unread`): on a GPU,
        where each read waits for the device (so the host could not queue a backward pass
        before its forward ran), with every statistic on one device (`_whole`), outside exact
        mode, and every layer's update factor a momentum, the same for all (their weights then
        need no counter: `_later_decay`)."""
        if not (self._whole and self.norms and self._exact is None
                and _device.batched_read(self._stat_tensors[0].device)):
            return False
        momenta = {m.momentum for _, m in self.norms}
        return len(momenta) == 1 and None not in momenta

    def _begin_whole(self, tracked: list[int | None]) -> None:
        """`begin`'s snapshot with every statistic on one device and dtype: one copy into a
        flat tensor and one zeroing of the flat sums (allocated at the first step and kept,
        with their views per layer), not a copy and an allocation per layer."""
        if self._flat_before is None or self._flat_sums is None:
            first = self._stat_tensors[0]
            sizes = [t.numel() for t in self._stat_tensors]
            self._flat_before = torch.empty(self._stats, dtype=first.dtype, device=first.device)
            self._flat_sums = torch.empty(self._stats, dtype=torch.float64, device=first.device)
            before, sums = self._flat_before.split(sizes), self._flat_sums.split(sizes)
            self._before_views = [(before[2 * i].view_as(m.running_mean),
                                   before[2 * i + 1].view_as(m.running_var))
                                  for i, (_, m) in enumerate(self.norms)]
            self._sums = [(sums[2 * i].view_as(m.running_mean),
                           sums[2 * i + 1].view_as(m.running_var))
                          for i, (_, m) in enumerate(self.norms)]
        torch.cat(self._stat_flat, out=self._flat_before)
        self._flat_sums.zero_()
        self._before = [_Before(mean, var, n)
                        for (mean, var), n in zip(self._before_views, tracked, strict=True)]
        self._tracked = (torch.cat(self._count_views) if self._deferred else
                         torch.tensor(tracked, dtype=self._counts[0].dtype,
                                      device=self._counts[0].device))

    def before_piece(self, k: int) -> None:
        """Before forward pass `k` (its place in the step's global order): the running
        statistics of the layers in training mode zeroed, so that the forward leaves its term
        in them. A layer in eval mode (a frozen one: `norm_eval`, fine-tuning) normalises with
        its statistics, which stay as they are; its forward adds no term."""
        with torch.no_grad():
            if self._stat_tensors:
                self._training = training = [m.training for _, m in self.norms]
                if all(training):
                    torch._foreach_zero_(self._stat_tensors)
                elif any(training):
                    torch._foreach_zero_([t for (_, m), on in zip(self.norms, training, strict=True)
                                          if on for t in (m.running_mean, m.running_var)])
            self._set_counts(k)

    def _set_counts(self, k: int) -> None:
        """Every layer's `num_batches_tracked` to its value at `begin` plus `k` (as a whole:
        two kernels on a GPU, not one per layer)."""
        with torch.no_grad():
            if self._whole and self._tracked is not None:
                values = self._tracked + k if k else self._tracked
                torch._foreach_copy_(self._counts, list(values.unbind()))
                return
            for (_, m), before in zip(self.norms, self._before, strict=True):
                assert before.tracked is not None
                m.num_batches_tracked.fill_(before.tracked + k)

    def after_piece(self, k: int) -> None:
        """After forward pass `k` (before its backward, which activation checkpointing may use
        to run the layers again): adds its terms to this rank's sums.

        Raises:
            ValueError: a BatchNorm layer ran more than once in one forward pass, or in exact
                mode the forward changed another buffer.
        """
        if self._deferred:
            self._after_piece_deferred(k)
            return
        exact = self._exact
        if exact is not None:
            for (name, b), b0 in zip(self.others, self._others_before, strict=True):
                if not torch.equal(b, b0):
                    raise ValueError(
                        f"the forward pass changed buffer {name!r}; with batch.exact every buffer "
                        "must be the same bits for any split, and elastic can make that so for "
                        "BatchNorm running statistics only. Keep it as a plain attribute "
                        "(not a registered buffer), or set batch.exact=False")
        counts = _read_counts(self._count_views)
        weights: list[float | None] = []  # None: the layer did not run in training mode
        for i, ((name, m), before, count) in enumerate(
                zip(self.norms, self._before, counts, strict=True)):
            assert before.tracked is not None
            calls = count - (before.tracked + k)
            if calls not in (0, 1):
                raise _ran_again(name, calls)
            weights.append(self._later_decay(m, before.tracked, k) if calls else None)
            self._ran[i] = self._ran[i] or calls == 1
        if (exact is None and self._flat_sums is not None and weights
                and len(set(weights)) == 1 and weights[0] is not None):
            # Every layer ran, with one weight: the same additions, as a whole.
            stats = torch.cat(self._stat_flat)
            self._flat_sums.add_(stats.to(torch.float64), alpha=weights[0])
            return
        if exact is not None:  # every layer's terms at once (one read of their peaks)
            exact.add_many([pair for i, ((_, m), weight) in enumerate(zip(self.norms, weights,
                                                                          strict=True))
                            if weight is not None for pair in (
                                (self._slot + 2 * i, m.running_mean.detach().to(torch.float64) * weight),
                                (self._slot + 2 * i + 1, m.running_var.detach().to(torch.float64) * weight))])
            return
        for (_, m), (mean, var), weight in zip(self.norms, self._sums, weights, strict=True):
            if weight is None:
                continue
            mean.add_(m.running_mean.detach().to(torch.float64), alpha=weight)
            var.add_(m.running_var.detach().to(torch.float64), alpha=weight)

    def _after_piece_deferred(self, k: int) -> None:
        """`after_piece` on a GPU: the layers' calls kept on the device (checked in the step's
        one read), and the terms of the layers in training mode added with the one weight of
        their momentum. A layer in training mode that did not run holds zeros (`before_piece`):
        its term adds nothing."""
        assert self._flat_sums is not None and self._tracked is not None
        self._calls.append(torch.cat(self._count_views).sub_(self._tracked).sub_(k))
        self._stacked = None
        weight = self._later_decay(self.norms[0][1], None, k)
        if all(self._training):
            self._flat_sums.add_(torch.cat(self._stat_flat).to(torch.float64), alpha=weight)
            return
        for ((_, m), (mean, var), on) in zip(self.norms, self._sums, self._training, strict=True):
            if on:
                mean.add_(m.running_mean.detach().to(torch.float64), alpha=weight)
                var.add_(m.running_var.detach().to(torch.float64), alpha=weight)

    def unread(self) -> list[torch.Tensor]:
        """On a GPU, the values the step's one read (`host_values`) takes for this step's
        forward passes: how many times a layer ran other than 0 or 1 in one of them (0: all
        is well; `settle` raises otherwise). Empty where `after_piece` checked them itself."""
        if not self._calls:
            return []
        calls = self._all_calls()
        return [((calls < 0) | (calls > 1)).sum()]

    def _all_calls(self) -> torch.Tensor:
        """This step's calls per forward pass and layer, as one tensor on the device."""
        if self._stacked is None:
            self._stacked = torch.stack(self._calls)
        return self._stacked

    def settle(self, values: list[float]) -> None:
        """Takes the values read for `unread`.

        Raises:
            ValueError: a BatchNorm layer ran more than once in one forward pass.
        """
        if not values or values[0] == 0:
            return
        for calls in self._calls:  # an error: the counters read to name the layer
            for (name, _), ran in zip(self.norms, calls.tolist(), strict=True):
                if ran not in (0, 1):
                    raise _ran_again(name, ran)

    def _later_decay(self, m: _BatchNorm, tracked: int | None, k: int) -> float:
        """prod over the pieces i after `k` of (1 - f_i), in closed form: (1 - m)^(n - k - 1)
        for momentum m; for the cumulative average (f_i = 1 / (tracked + i + 1)) the product
        telescopes to (tracked + k + 1) / (tracked + n)."""
        n = self._pieces
        if m.momentum is not None:
            return (1.0 - float(m.momentum)) ** (n - k - 1)
        assert tracked is not None, "a cumulative average needs the layer's count"
        return (tracked + k + 1) / (tracked + n) if tracked + n > 0 else 1.0

    def section(self) -> torch.Tensor:
        """This rank's metadata section (float64 here; it is summed in the gradients' widest
        floating dtype, float32 for a float32 model): whether a forward changed another buffer,
        which BatchNorm layers ran, and this rank's terms of their running statistics. Leaves
        every buffer as it was at `begin`'s snapshot except the other buffers' new values."""
        parts = [torch.tensor([float(self._others_changed())], dtype=torch.float64)]
        if self._deferred and self._calls:  # which layers ran: from the counters on the device
            assert self._flat_sums is not None
            ran = (self._all_calls() == 1).any(0)
            parts.append(torch.cat([ran.to(torch.float64), self._flat_sums]).cpu())
        else:
            parts.append(torch.tensor([float(r) for r in self._ran], dtype=torch.float64))
            if self._exact is None and self._sums:
                # Joined where they lie, then one copy to the host (on a GPU: one read, not
                # one per layer, each of which would wait for the device).
                flat = (self._flat_sums if self._flat_sums is not None else
                        torch.cat([t.reshape(-1) for pair in self._sums for t in pair]))
                parts.append(flat.cpu())
        self._restore_norms()
        return torch.cat(parts)

    def _others_changed(self) -> bool:
        """Whether a forward changed another buffer: on a GPU one read for all of them (a
        `torch.equal` each waits for the device once per buffer: Hugging Face models keep
        position ids and rotary frequencies as buffers), else compared one by one."""
        pairs = list(zip((b for _, b in self.others), self._others_before, strict=True))
        if not pairs:
            return False
        if any(b.shape != b0.shape or b.dtype != b0.dtype for b, b0 in pairs):
            return True
        devices = {b.device for b, _ in pairs}
        if len(devices) > 1 or not _device.batched_read(devices.pop()):
            return any(not torch.equal(b, b0) for b, b0 in pairs)
        # NaN != NaN, as torch.equal has it
        return bool(torch.stack([torch.ne(b, b0).any() for b, b0 in pairs]).any())

    def commit(self, summed: torch.Tensor, comm: Communicator, src: int) -> None:
        """Writes the step's buffers from the summed sections: the BatchNorm statistics as one
        process running the step's pieces in order would have them, and, if any rank's forward
        changed another buffer, those of rank `src` (a collective every rank issues).

        Raises:
            CollectiveError: the broadcast failed; the buffers are left as before the step.
        """
        changed = float(summed[0]) > 0
        ran = summed[1 : 1 + len(self.norms)]
        offset = 1 + len(self.norms)
        exact = self._exact
        if exact is None and self._whole and self.norms:
            # To the device in one copy (one per layer would each wait for it).
            stats = summed[offset : offset + self._stats].to(self._stat_tensors[0].device)
            summed, offset = stats, 0
            keeps = {self._later_decay(m, before.tracked, -1) for (_, m), before in
                     zip(self.norms, self._before, strict=True)}
            if len(keeps) == 1 and bool((ran > 0).all()):
                self._commit_whole(stats, keeps.pop())
                self._after_commit(changed, comm, src)
                return
        # Exact mode: every layer's sums to the device in one copy.
        sums = (exact.values(range(self._slot, self._slot + 2 * len(self.norms)),
                             self.norms[0][1].running_mean.device)
                if exact is not None and self.norms else [])
        reached = ran.tolist()  # the host's (the summed sections): one read, not one per layer
        with torch.no_grad():
            for i, ((_, m), before) in enumerate(zip(self.norms, self._before, strict=True)):
                n = m.running_mean.numel()
                if exact is not None:
                    mean, var = sums[2 * i], sums[2 * i + 1]
                else:
                    mean, var = summed[offset : offset + n], summed[offset + n : offset + 2 * n]
                    offset += 2 * n
                if reached[i] <= 0:
                    continue
                keep = self._later_decay(m, before.tracked, -1)
                m.running_mean.copy_((before.mean.to(torch.float64) * keep + mean.to(
                    before.mean.device)).to(m.running_mean.dtype))
                m.running_var.copy_((before.var.to(torch.float64) * keep + var.to(
                    before.var.device)).to(m.running_var.dtype))
                if before.tracked is None:  # on the device
                    assert self._tracked is not None
                    m.num_batches_tracked.copy_(self._tracked[i] + self._pieces)
                else:
                    m.num_batches_tracked.fill_(before.tracked + self._pieces)
        self._after_commit(changed, comm, src)

    def _commit_whole(self, stats: torch.Tensor, keep: float) -> None:
        """`commit` of every layer at once (each ran, all with the same `keep`): the same
        arithmetic as layer by layer, on flat tensors."""
        assert self._flat_before is not None
        new = (self._flat_before.to(torch.float64) * keep + stats).to(self._stat_tensors[0].dtype)
        with torch.no_grad():
            torch._foreach_copy_(self._stat_tensors,
                                 [v.view_as(t) for v, t in zip(
                                     new.split([t.numel() for t in self._stat_tensors]),
                                     self._stat_tensors, strict=True)])
        self._set_counts(self._pieces)

    def _after_commit(self, changed: bool, comm: Communicator, src: int) -> None:
        if changed and self.others:
            try:
                self._broadcast_others(comm, src)
            except Exception:
                self.rollback()
                raise

    def _broadcast_others(self, comm: Communicator, src: int) -> None:
        tensors = [b for _, b in self.others]
        flat = torch.cat([t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
                          for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
        comm.control.broadcast(flat, src)  # host bytes: the control plane
        offset = 0
        with torch.no_grad():
            for t in tensors:
                size = t.numel() * t.element_size()
                t.copy_(flat[offset : offset + size].clone().view(t.dtype).reshape(t.shape))
                offset += size

    def _restore_norms(self) -> None:
        with torch.no_grad():
            if self._before:
                torch._foreach_copy_(self._stat_tensors,
                                     [t for b in self._before for t in (b.mean, b.var)])
        if self._before:
            self._set_counts(0)

    def rollback(self) -> None:
        """Every buffer as it was before the step (a step voted down or not applied)."""
        if not self._before and not self._others_before:
            return
        self._restore_norms()
        with torch.no_grad():
            for (_, b), b0 in zip(self.others, self._others_before, strict=True):
                b.copy_(b0)
