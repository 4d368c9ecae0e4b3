"""The adapt policies (pure) and the data cursor they move."""

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastic.adapt.balance import ThroughputTracker, predicted_compute_s, rebalance
from elastic.adapt.lr import LrRamp, global_batch_for, lr_factor, resize
from elastic.adapt.tuning import MicroBatchTuner, back_off, candidates
from elastic.trainer.data import Cursor, SampleOrder, epoch_permutation

# --- micro-batch tuning -------------------------------------------------------------------


def test_candidates_are_the_largest_allowed_then_halvings():
    assert candidates(24, None, 3) == (24, 12, 6)
    assert candidates(24, 10, 3) == (10, 5, 2)
    assert candidates(3, None, 5) == (3, 1)
    assert candidates(1, None, 3) == (1,)
    assert candidates(0, None, 3) == (1,)


def test_the_tuner_tries_every_candidate_and_keeps_the_fastest():
    tuner = MicroBatchTuner((8, 4, 2), steps_per_trial=2, reason="start")
    seen = []
    step_times = {8: [0.5, 0.3], 4: [0.2, 0.25], 2: [0.4, 0.4]}
    while (trial := tuner.next_trial()) is not None:
        assert tuner.decision() is None
        seen.append(trial)
        tuner.observe(trial, 64, step_times[trial])
    assert seen == [8, 4, 2]
    decision = tuner.decision()
    assert decision.micro_batch == 4
    assert decision.samples_per_s == {8: 64 / 0.3, 4: 64 / 0.2, 2: 64 / 0.4}
    assert decision.reason == "start"


def test_a_trial_cut_short_goes_on_until_it_has_its_steps():
    tuner = MicroBatchTuner((4, 2), steps_per_trial=2, reason="resize")
    tuner.observe(4, 16, [])
    assert tuner.next_trial() == 4
    tuner.observe(4, 16, [0.5])
    assert tuner.next_trial() == 4 and tuner.steps_left(4) == 1
    tuner.observe(4, 16, [0.25])
    assert tuner.next_trial() == 2


def test_out_of_memory_halves_the_micro_batch_until_one():
    assert back_off(7, 1, 3, 8).after == 4
    assert back_off(7, 1, 3, 3).after == 1
    last = back_off(7, 1, 3, 1)
    assert last.after is None and last.before == 1 and last.step == 7 and last.worker_id == 3


# --- heterogeneity-aware shares -------------------------------------------------------------


def test_the_tracker_averages_each_workers_rate():
    tracker = ThroughputTracker(alpha=0.5)
    tracker.observe(0, 100, 1.0)
    tracker.observe(0, 100, 0.5)
    assert tracker.rate(0) == pytest.approx(150.0)
    assert tracker.count(0) == 2 and tracker.rate(1) is None
    tracker.observe(1, 0, 1.0)  # a rank with no samples says nothing about its speed
    assert tracker.rate(1) is None
    tracker.forget(0)
    assert tracker.rate(0) is None


def test_a_rank_twice_as_slow_gets_about_half_the_samples():
    decision = rebalance(64, (16, 16, 16, 16), (100.0, 100.0, 100.0, 50.0), threshold=0.1)
    assert decision is not None
    assert sum(decision.shares_after) == 64
    assert decision.shares_after[3] * 2 == pytest.approx(decision.shares_after[0], abs=2)
    assert decision.predicted_after_s < 0.8 * decision.predicted_before_s
    assert decision.predicted_before_s == predicted_compute_s((16, 16, 16, 16), (100, 100, 100, 50))


def test_no_rebalance_when_communication_dominates_the_step():
    # Compute 16 ms of a 100 ms step: halving it saves less than 15% of the step.
    assert rebalance(64, (32, 32), (4000.0, 2000.0), 0.15, step_time_s=0.1) is None
    assert rebalance(64, (32, 32), (4000.0, 2000.0), 0.15, step_time_s=0.02) is not None


def test_no_rebalance_below_the_threshold():
    assert rebalance(64, (16, 16, 16, 16), (100.0, 101.0, 99.0, 100.0), threshold=0.1) is None
    assert rebalance(64, (16, 16, 16, 16), (100.0,) * 4, threshold=0.1) is None


@given(st.integers(2, 5000), st.lists(st.floats(0.1, 1000.0), min_size=1, max_size=64),
       st.floats(0.01, 0.5))
def test_a_rebalance_never_predicts_a_slower_step(batch, rates, threshold):
    shares = tuple(batch // len(rates) + (1 if r < batch % len(rates) else 0) for r in range(len(rates)))
    decision = rebalance(batch, shares, rates, threshold)
    if decision is not None:
        assert sum(decision.shares_after) == batch
        assert decision.predicted_after_s <= (1 - threshold) * decision.predicted_before_s


# --- batch policy and learning rate ---------------------------------------------------------


def test_the_global_batch_follows_the_world_size_only_when_asked():
    assert global_batch_for("fixed", 64, 4, 3) == 64
    assert global_batch_for("scale_with_workers", 64, 4, 3) == 48
    assert global_batch_for("scale_with_workers", 64, 4, 8) == 128


def test_learning_rate_rules():
    assert lr_factor("linear", 128, 64) == 2.0
    assert lr_factor("sqrt", 128, 32) == 2.0
    assert lr_factor("none", 128, 64) == 1.0
    with pytest.raises(ValueError, match="unknown"):
        lr_factor("cubic", 1, 1)


def test_the_ramp_goes_linearly_from_the_old_factor_to_the_new():
    ramp = LrRamp(start_step=10, warmup_steps=4, from_factor=1.0, to_factor=0.5)
    assert [ramp.factor(s) for s in range(9, 16)] == [1.0, 0.875, 0.75, 0.625, 0.5, 0.5, 0.5]
    assert LrRamp(3, 0, 1.0, 2.0).factor(3) == 2.0


def test_a_resize_ramps_from_the_factor_in_force():
    start = resize("scale_with_workers", "linear", 4, 64, 4, 4, step=0, current=None)
    assert start.global_batch_size == 64 and start.ramp.factor(0) == 1.0
    assert start.ramp.warmup_steps == 0
    shrink = resize("scale_with_workers", "linear", 4, 64, 4, 2, step=8, current=start.ramp)
    assert shrink.global_batch_size == 32
    assert [shrink.ramp.factor(s) for s in range(8, 13)] == [0.875, 0.75, 0.625, 0.5, 0.5]
    # A change in the middle of a ramp starts from where the ramp was.
    grow = resize("scale_with_workers", "sqrt", 4, 64, 4, 16, step=9, current=shrink.ramp)
    assert grow.ramp.from_factor == 0.875 and grow.ramp.to_factor == 2.0
    fixed = resize("fixed", "linear", 0, 64, 4, 2, step=3, current=None)
    assert fixed.global_batch_size == 64 and fixed.ramp.factor(3) == 1.0


def test_a_ramp_reads_back_from_its_manifest_record_and_nothing_else_passes_for_one():
    ramp = LrRamp(start_step=10, warmup_steps=4, from_factor=1.0, to_factor=0.5)
    assert LrRamp.from_dict(ramp.to_dict()) == ramp
    assert LrRamp.from_dict(json.loads(json.dumps(ramp.to_dict()))) == ramp
    # What is left of it at a step it is restored at gives the same factors from there on.
    for step in (5, 10, 11, 13, 14, 20):
        rest = ramp.rest_from(step)
        assert [rest.factor(s) for s in range(step, 20)] == pytest.approx(
            [ramp.factor(s) for s in range(step, 20)], rel=1e-15)
    assert ramp.rest_from(12) == LrRamp(start_step=12, warmup_steps=2, from_factor=0.75,
                                        to_factor=0.5)
    assert ramp.rest_from(30) is ramp  # over: a restore changes nothing (no batch_planned)
    for bad in (None, [], {}, {**ramp.to_dict(), "start_step": -1},
                {**ramp.to_dict(), "warmup_steps": True}, {**ramp.to_dict(), "to_factor": "1"},
                {**ramp.to_dict(), "from_factor": float("nan")},
                {**ramp.to_dict(), "to_factor": 0.0}):
        assert LrRamp.from_dict(bad) is None, bad


def test_a_new_generation_at_the_same_size_keeps_the_ramp_in_progress():
    # A replacement (or a straggler swapped) at step 150 of a 100-step ramp 1 -> 2 from step
    # 100: before, a new ramp 1.5 -> 2 began there, ending at 250 instead of 200.
    grow = resize("scale_with_workers", "linear", 100, 64, 4, 8, step=100,
                  current=LrRamp(0, 0, 1.0, 1.0))
    again = resize("scale_with_workers", "linear", 100, 64, 4, 8, step=150, current=grow.ramp)
    assert again.ramp is grow.ramp and again.global_batch_size == 128
    assert again.ramp.factor(199) == 2.0 and again.ramp.factor(149) == 1.5


# --- the data cursor -------------------------------------------------------------------------


@given(st.integers(1, 300), st.integers(1, 64), st.integers(0, 400))
def test_with_a_fixed_batch_the_cursor_is_the_published_step_order(n, b, steps):
    if b > n:
        return
    per_epoch = n // b
    order = SampleOrder(n, seed=5)
    cursor = Cursor()
    for step in range(min(steps, 3 * per_epoch + 1)):
        epoch, idx = order.batch(cursor, b)
        e, s = divmod(step, per_epoch)
        assert epoch == e
        assert torch.equal(idx, epoch_permutation(n, 5, e)[s * b : (s + 1) * b])
        cursor = cursor.advance(n, b)
        assert cursor.step == step + 1 and cursor.samples == (step + 1) * b
        assert Cursor.from_dict({"global_step": cursor.step}, n, b) == cursor


@given(st.lists(st.integers(1, 40), min_size=1, max_size=60))
def test_with_changing_batches_no_index_is_seen_twice_in_an_epoch(batches):
    n = 97
    order = SampleOrder(n, seed=0)
    cursor = Cursor()
    seen: dict[int, list[int]] = {}
    for b in batches:
        epoch, idx = order.batch(cursor, b)
        assert len(idx) == b
        seen.setdefault(epoch, []).extend(idx.tolist())
        cursor = cursor.advance(n, b)
    for indices in seen.values():
        assert len(indices) == len(set(indices))
    assert cursor.samples == sum(batches)
    assert Cursor.from_dict(cursor.to_dict(), n, 1) == cursor


def test_steps_left_and_epochs_done():
    cursor = Cursor(step=5, epoch=0, offset=80, samples=80)
    assert cursor.steps_left_in_epoch(96, 16) == 1
    assert cursor.epochs_done(96, 16) == 0
    after = cursor.advance(96, 16)
    assert after.epochs_done(96, 16) == 1 and after.steps_left_in_epoch(96, 16) == 6
    assert after.epochs_done(96, 10) == 1 and math.isclose(after.steps_left_in_epoch(96, 10), 9)
