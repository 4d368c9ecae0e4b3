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
