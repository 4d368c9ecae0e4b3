"""The batch side of the control loop: the global batch in force, each chunk's plan, the
micro-batch tuner, the rebalancer, and the per-step metrics and ledger a chunk leaves.

`Batching` holds the state the adapt policies (`elastic.adapt`) need between chunks and turns
their decisions into events; it never talks to workers.

No Ray here.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from elastic.adapt.balance import Rebalancer, ThroughputTracker
from elastic.adapt.groups import Grouping, decide_grouping
from elastic.adapt.lr import LrRamp, global_batch_for, resize
from elastic.adapt.plan import BatchPlan, plan_batch
from elastic.adapt.stragglers import StragglerWatch
from elastic.adapt.tuning import MicroBatchTuner, OomBackoff, candidates
from elastic.config import FitConfig
from elastic.control import decisions
from elastic.events import (
    BatchPlanned,
    Grouped,
    MicroBatchTuned,
    Nonfinite,
    Rebalanced,
    RebalanceJudged,
)
from elastic.events import OomBackoff as OomBackedOff
from elastic.runlog import RunLog


class Batching:
    """The global batch, the learning-rate ramp, shares and micro-batches between chunks.

    Args:
        config: the run's configuration.
        log: the run's event and metric log.
        world_size: the initial world size (for policy 'scale_with_workers').
        traits: the model's BatchNorm and dropout layers (`Replica.traits`; None: neither).
    """

    def __init__(self, config: FitConfig, log: RunLog, world_size: int,
                 traits: Mapping[str, int] | None = None) -> None:
        self.config = config
        self.log = log
        batch = config.batch
        traits = traits or {}
        self.grouping: Grouping = decide_grouping(
            batch.groups, batch.group_size, batch.global_batch_size, config.scaling.num_workers,
            batch.policy, traits.get("batchnorm", 0), traits.get("dropout", 0),
            batch.max_micro_batch, batch.exact)
        self.traits = {"batchnorm": traits.get("batchnorm", 0), "dropout": traits.get("dropout", 0)}
        self.log.emit(Grouped(groups=self.grouping.on, group_size=self.grouping.size,
                              pinned=self.grouping.pinned, reason=self.grouping.reason,
                              **self.traits))
        self._idle = 0  # members without a share, last said
        self.batch_now = global_batch_for(batch.policy, batch.global_batch_size,
                                          config.scaling.num_workers, world_size)
        self.lr_ramp: LrRamp | None = None
        # The steps committed by the last chunk whose metrics lines are being written (the
        # run's cursor moves on once they are): a callback's stop there may come too late.
        self.recorded = 0
        self._said: LrRamp | None = None  # the ramp of the last `batch_planned` event
        self.tracker = ThroughputTracker()
        failure = config.failure
        self.stragglers: StragglerWatch | None = (
            StragglerWatch(failure.straggler_factor, failure.straggler_window)
            if failure.straggler_factor else None)
        self.slow: list[int] = []  # the stragglers after the last completed chunk, slowest first
        self.rebalancer = Rebalancer(batch.rebalance_threshold)
        self.rates: dict[int, float] = {}  # worker id -> rate at the last rebalance
        self.micro_caps: dict[int, int] = {}  # worker id -> cap after out-of-memory errors
        self.tuned_micro: int | None = None
        self.tuner: MicroBatchTuner | None = None
        self.plan: BatchPlan | None = None

    def largest_batch(self) -> int:
        """The global batch at `max_workers` (checked against the data set's size)."""
        batch, scaling = self.config.batch, self.config.scaling
        return global_batch_for(batch.policy, batch.global_batch_size, scaling.num_workers,
                                scaling.upper)

    def replan(self, reason: str, ids: Sequence[int], step: int) -> None:
        """After a new generation of members `ids`: the global batch and learning-rate ramp for
        its size (policy 'scale_with_workers') and a new micro-batch tuning."""
        batch = self.config.batch
        n = len(ids)
        if batch.policy != "fixed":
            decision = resize(batch.policy, batch.lr_scaling, batch.warmup_steps,
                              batch.global_batch_size, self.config.scaling.num_workers, n, step,
                              self.lr_ramp)
            if decision.global_batch_size != self.batch_now or self._said is None \
                    or decision.ramp != self._said:
                self.log.emit(BatchPlanned(reason=reason, world_size=n, step=step,
                               global_batch_size=decision.global_batch_size,
                               lr_factor_from=decision.ramp.from_factor,
                               lr_factor_to=decision.ramp.to_factor,
                               warmup_steps=decision.ramp.warmup_steps))
                self._said = decision.ramp
            self.batch_now = decision.global_batch_size
            self.lr_ramp = decision.ramp
        self._say_idle(n)
        self.rebalancer.membership_changed()
        if self.stragglers is not None:
            self.stragglers.reset()
            self.slow = []
        self.tuner = None
        if batch.autotune and not self.grouping.on and not self.grouping.pinned:
            largest = max(plan_batch(self.batch_now, n, batch.max_micro_batch,
                                     self.weights(ids)).shares)
            options = candidates(largest, batch.max_micro_batch, batch.autotune_candidates)
            if len(options) > 1:
                self.tuner = MicroBatchTuner(options, batch.autotune_steps, reason)
                self.tuned_micro = None

    def restore_ramp(self, ramp: LrRamp, step: int) -> None:
        """The learning-rate ramp a checkpoint of `step` recorded as in force, for a run
        restored from it (a resume, a restarted controller, every holder lost): the next
        `replan` goes on from what is left of it. Before, a resume in the middle of a ramp
        jumped to its target factor. A run of policy 'fixed' has no ramp and takes none."""
        if self.config.batch.policy != "fixed":
            self.lr_ramp = ramp.rest_from(step)

    def _say_idle(self, n: int) -> None:
        """With groups on, a world of more members than the global batch has groups leaves
        some without a share: said (a `grouped` event) whenever how many changes, since a
        scale up then buys nothing."""
        grouping = self.grouping
        idle = max(0, n - self.batch_now // grouping.size) if grouping.on else 0
        if idle and idle != self._idle:
            self.log.emit(Grouped(
                groups=True, group_size=grouping.size, pinned=False, **self.traits,
                reason=f"{idle} of {n} workers have no share: the global batch is "
                f"{self.batch_now // grouping.size} groups of {grouping.size} samples and a "
                "group runs whole on one worker; they stay members and take over when others "
                "die (a smaller batch.group_size, set at the start, spreads a step over more "
                "workers but changes the math of BatchNorm and dropout)"))
        self._idle = idle

    def weights(self, ids: Sequence[int]) -> list[float] | None:
        """Relative throughput of members `ids`, or None for an even split."""
        if not self.config.batch.rebalance or self.grouping.pinned or not self.rates:
            return None
        return decisions.weights(self.rates, ids)

    def next_plan(self, ids: Sequence[int]) -> tuple[BatchPlan, int | None]:
        """The plan of the next chunk and the micro-batch trial it runs (None if none)."""
        trial = self.tuner.next_trial() if self.tuner is not None else None
        common = trial if trial is not None else self.tuned_micro
        grouping = self.grouping
        self.plan = plan_batch(self.batch_now, len(ids),
                               grouping.size if grouping.on else self.config.batch.max_micro_batch,
                               self.weights(ids), decisions.micro_caps(ids, common, self.micro_caps),
                               unit=grouping.size)
        return self.plan, trial

    def trial_steps_left(self, trial: int | None) -> int | None:
        return self.tuner.steps_left(trial) if trial is not None and self.tuner else None

    def backed_off(self, decision: OomBackoff) -> None:
        """Records an out-of-memory back-off (a cap for that worker from now on)."""
        self.log.emit(OomBackedOff(step=decision.step, rank=decision.rank,
                       worker_id=decision.worker_id, micro_batch_before=decision.before,
                       micro_batch_after=decision.after))
        if decision.after is not None:
            self.micro_caps[decision.worker_id] = decision.after

    # --- after a chunk ------------------------------------------------------------------------

    def adapt(self, trial: int | None, records: Mapping[int, Sequence[Any]], ids: Sequence[int],
              step: int, plan: BatchPlan | None = None) -> None:
        """After a chunk that completed on every rank (under `plan`; default: the last one
        planned): the micro-batch trial's result, and a rebalance of the shares if the
        measured throughputs call for one. A chunk handed out ahead of a re-split ran under
        the shares before it: it neither judges the re-split nor calls for another."""
        step_times: dict[int, float] = {}  # a step lasts as long as its slowest rank
        compute_times: dict[int, float] = {}
        # A step some rank ran beside its checkpoint write measures that write, not a split.
        written = {r.step for rank_records in records.values() for r in rank_records if r.writing}
        for rank_records in records.values():
            for record in rank_records:
                step_times[record.step] = max(step_times.get(record.step, 0.0), record.step_time_s)
                if record.step not in written:
                    compute_times[record.step] = max(compute_times.get(record.step, 0.0),
                                                     record.compute_time_s)
        if trial is not None and self.tuner is not None:
            self._tuned(trial, list(step_times.values()), step)
            return
        if self.stragglers is not None and self.plan is not None:
            working = [w for w, share in zip(ids, self.plan.shares, strict=False) if share > 0]
            if len(working) >= 2 and all(self.tracker.count(w) >= 2 for w in working):
                self.slow = self.stragglers.observe({w: self.tracker.rate(w) or 0.0
                                                     for w in working})
        if not self.config.batch.rebalance or self.grouping.pinned or len(ids) < 2 \
                or self.plan is None or not compute_times:
            return
        if plan is not None and plan.shares != self.plan.shares:
            return
        compute = statistics.median_low(compute_times.values())
        self._judged(compute, step)
        # Members with no share (more workers than groups) have no rate: a typical one.
        working = [w for w, share in zip(ids, self.plan.shares, strict=True) if share > 0]
        if len(working) < 2 or any(self.tracker.count(w) < 2 for w in working):
            return
        measured = {w: self.tracker.rate(w) or 0.0 for w in working}
        if min(measured.values()) <= 0:
            return
        rates = decisions.weights(measured, ids)
        assert rates is not None
        decision = self.rebalancer.decide(self.batch_now, self.plan.shares, rates,
                                          step_time_s=statistics.median_low(step_times.values()),
                                          compute_s=compute, unit=self.grouping.size)
        if decision is None:
            return
        self.rates = dict(zip(ids, decision.samples_per_s, strict=True))
        self.log.emit(Rebalanced(step=step, shares_before=list(decision.shares_before),
                       shares_after=list(decision.shares_after),
                       samples_per_s=[round(r, 2) for r in decision.samples_per_s],
                       predicted_before_s=decision.predicted_before_s,
                       predicted_after_s=decision.predicted_after_s))

    def _tuned(self, trial: int, step_times: list[float], step: int) -> None:
        assert self.tuner is not None
        self.tuner.observe(trial, self.batch_now, step_times)
        decision = self.tuner.decision()
        if decision is not None:
            self.tuner, self.tuned_micro = None, decision.micro_batch
            self.log.emit(MicroBatchTuned(step=step, reason=decision.reason,
                           micro_batch=decision.micro_batch,
                           samples_per_s={str(k): round(v, 2)
                                          for k, v in decision.samples_per_s.items()}))

    def _judged(self, compute: float, step: int) -> None:
        judgement = self.rebalancer.observe(compute)
        if judgement is not None:
            self.log.emit(RebalanceJudged(step=step, delivered=judgement.delivered,
                           predicted_saving_s=judgement.predicted_saving_s,
                           realised_saving_s=judgement.realised_saving_s,
                           window=judgement.window, threshold=judgement.threshold))

    def record(self, records: Mapping[int, Sequence[Any]], ids: Sequence[int],
               generation: int) -> dict[int, dict[int, Any]]:
        """Writes one metrics line per committed step (and the ledger, if on) from every
        rank's records; feeds the throughput tracker. Returns step -> rank -> record."""
        by_step: dict[int, dict[int, Any]] = {}
        for rank, rank_records in records.items():
            for record in rank_records:
                by_step.setdefault(record.step, {})[rank] = record
                if not record.writing:  # a checkpoint write beside it: no measure of its speed
                    self.tracker.observe(ids[rank], record.shares[rank], record.compute_time_s)
        if by_step:
            self.recorded = max(by_step) + 1
        for step in sorted(by_step):
            self._metric(step, by_step[step], generation)
        return by_step

    def _metric(self, step: int, ranks: dict[int, Any], generation: int) -> None:
        records = list(ranks.values())
        first = records[0]
        b = first.global_batch_size
        step_time = max(r.step_time_s for r in records)
        slowest = max(records, key=lambda r: r.step_time_s)
        _, data_s, compute_s, comm_s, optimizer_s = slowest.timeline
        world = range(first.world_size)
        self.log.metric(step=step, epoch=first.epoch, loss=first.loss,
                        world_size=first.world_size, global_batch_size=b,
                        shares=list(first.shares), micro_batch=max(r.micro_batch for r in records),
                        micro_batches=[ranks[r].micro_batch if r in ranks else None for r in world],
                        step_time_s=step_time,
                        compute_time_s=max(r.compute_time_s for r in records),
                        samples_per_s=b / step_time if step_time > 0 else None, lr=first.lr,
                        generation=generation, time=max(r.end_time for r in records),
                        data_s=data_s, forward_backward_s=compute_s, comm_s=comm_s,
                        optimizer_s=optimizer_s,
                        timeline=[[round(x, 6) for x in ranks[r].timeline] if r in ranks else None
                                  for r in world],
                        **({"rescaled": first.rescaled} if first.rescaled else {}),
                        **_training_fields(first))
        skipped = sorted({r for rec in records for r in rec.skipped_ranks})
        if skipped:
            self.log.emit(Nonfinite(step=step, ranks=skipped, policy="skip"))
        if self.config.ledger and first.indices is not None:
            self.log.ledger(step, first.epoch, list(first.indices))


def _training_fields(record: Any) -> dict[str, Any]:
    """The metrics line's user metrics, pre-clip gradient norm and fp16 loss scale, when the
    step has them (records from before these fields have none)."""
    fields: dict[str, Any] = {}
    if getattr(record, "metrics", None):
        fields["metrics"] = dict(record.metrics)
    if getattr(record, "grad_norm", None) is not None:
        fields["grad_norm"] = record.grad_norm
    if getattr(record, "scale", None) is not None:
        fields["scale"] = record.scale
    return fields
