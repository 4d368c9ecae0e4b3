import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic.adapt.plan import apportion, plan_batch


@given(batch=st.integers(1, 10_000), world=st.integers(1, 128),
       cap=st.one_of(st.none(), st.integers(1, 512)))
def test_shares_sum_to_the_batch_and_micro_batches_respect_the_cap(batch, world, cap):
    plan = plan_batch(batch, world, cap)
    assert sum(plan.shares) == batch
    assert len(plan.shares) == world
    assert min(plan.shares) >= 0
    assert max(plan.shares) - min(plan.shares) <= 1
    for rank in range(world):
        assert plan.micro_batches[rank] >= 1
        if cap is not None:
            assert plan.micro_batches[rank] <= cap
        pieces = plan.pieces(rank)
        assert sum(length for _, length in pieces) == plan.shares[rank]
        assert all(0 < length <= plan.micro_batches[rank] for _, length in pieces)
        assert len(pieces) == (plan.accumulation(rank) if plan.shares[rank] else 0)
    assert plan == plan_batch(batch, world, cap)


@st.composite
def weighted(draw):
    world = draw(st.integers(1, 128))
    weights = draw(st.lists(st.floats(0.01, 100.0), min_size=world, max_size=world))
    caps = draw(st.lists(st.one_of(st.none(), st.integers(1, 64)), min_size=world, max_size=world))
    return draw(st.integers(1, 10_000)), world, weights, caps


@given(weighted(), st.one_of(st.none(), st.integers(1, 512)))
def test_weighted_shares_sum_to_the_batch_and_follow_the_weights(case, cap):
    batch, world, weights, caps = case
    plan = plan_batch(batch, world, cap, weights=weights, micro_caps=caps)
    assert sum(plan.shares) == batch and min(plan.shares) >= 0
    if batch >= world:
        assert min(plan.shares) >= 1  # every rank keeps being measured
    # Largest remainder: no share is more than one sample (plus the floor of 1) off its quota.
    floor = 1 if batch >= world else 0
    rest = batch - floor * world
    for share, w in zip(plan.shares, weights, strict=True):
        assert abs((share - floor) - rest * w / sum(weights)) < 1 + 1e-6
    for rank in range(world):
        limits = [x for x in (cap, caps[rank]) if x is not None]
        assert 1 <= plan.micro_batches[rank] <= max(1, min([plan.shares[rank], *limits]))
        assert sum(length for _, length in plan.pieces(rank)) == plan.shares[rank]
    assert plan == plan_batch(batch, world, cap, weights=weights, micro_caps=caps)


def test_a_rank_twice_as_fast_gets_twice_the_samples():
    assert plan_batch(70, 4, None, weights=[2.0, 2.0, 2.0, 1.0]).shares == (20, 20, 20, 10)


def test_equal_weights_give_the_even_split():
    assert apportion(10, [1.0] * 4) == plan_batch(10, 4, None).shares == (3, 3, 2, 2)


def test_a_micro_batch_cap_on_one_rank_leaves_the_others_alone():
    plan = plan_batch(32, 4, None, micro_caps=[None, 2, None, None])
    assert plan.micro_batches == (8, 2, 8, 8)
    assert plan.accumulation(1) == 4 and plan.accumulation(0) == 1


def test_offsets_tile_the_global_batch():
    plan = plan_batch(10, 4, None)
    assert plan.shares == (3, 3, 2, 2)
    assert [plan.offset(r) for r in range(4)] == [0, 3, 6, 8]


def test_a_world_larger_than_the_batch_gets_zero_shares():
    plan = plan_batch(3, 5, 2)
    assert plan.shares == (1, 1, 1, 0, 0)
    assert plan.pieces(4) == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        plan_batch(8, 0, None)
    with pytest.raises(ValueError, match="weights"):
        plan_batch(8, 2, None, weights=[1.0, 0.0])
    with pytest.raises(ValueError, match="2 weights for 3 ranks"):
        plan_batch(8, 3, None, weights=[1.0, 1.0])


def test_a_recovery_breakdown_adds_up_to_its_total():
    from elastic.recovery import PendingRecovery

    rec = PendingRecovery(detected=10.02, killed_at=10.0, aborted=10.05, rebuilt=10.15,
                          restored=10.2, lost_ranks=[1], work_lost_steps=1, world_before=4,
                          world_after=3, step=7)
    fields = rec.breakdown(first_step_end=10.3)
    stages = ("detect_s", "abort_s", "rebuild_s", "restore_s", "first_step_s")
    assert sum(fields[k] for k in stages) == pytest.approx(fields["total_s"])
    assert fields["total_s"] == pytest.approx(0.3)
    assert fields["world_before"] == 4 and fields["world_after"] == 3
