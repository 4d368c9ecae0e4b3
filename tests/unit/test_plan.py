import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic.adapt.plan import plan_batch


@given(batch=st.integers(1, 10_000), world=st.integers(1, 128),
       cap=st.one_of(st.none(), st.integers(1, 512)))
def test_shares_sum_to_the_batch_and_micro_batches_respect_the_cap(batch, world, cap):
    plan = plan_batch(batch, world, cap)
    assert sum(plan.shares) == batch
    assert len(plan.shares) == world
    assert min(plan.shares) >= 0
    assert max(plan.shares) - min(plan.shares) <= 1
    if cap is not None:
        assert plan.micro_batch <= cap
    for rank in range(world):
        pieces = plan.micro_batches(rank)
        assert sum(length for _, length in pieces) == plan.shares[rank]
        assert all(0 < length <= plan.micro_batch for _, length in pieces)
    assert plan == plan_batch(batch, world, cap)


def test_offsets_tile_the_global_batch():
    plan = plan_batch(10, 4, None)
    assert plan.shares == (3, 3, 2, 2)
    assert [plan.offset(r) for r in range(4)] == [0, 3, 6, 8]


def test_a_world_larger_than_the_batch_gets_zero_shares():
    plan = plan_batch(3, 5, 2)
    assert plan.shares == (1, 1, 1, 0, 0)
    assert plan.micro_batches(4) == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        plan_batch(8, 0, None)


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
