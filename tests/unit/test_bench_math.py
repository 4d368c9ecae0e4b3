import pytest

from elastic.bench.allreduce import AllreduceRecord, crossover, fit_alpha_beta, parse_size


def test_parse_size_understands_binary_units():
    assert parse_size("4KB") == 4096
    assert parse_size("16MB") == 16 << 20
    assert parse_size("123") == 123
    with pytest.raises(ValueError, match="16MB"):
        parse_size("sixteen")


def test_alpha_beta_fit_recovers_a_line():
    fit = fit_alpha_beta([(n, 1e-3 + 2e-9 * n) for n in (1 << 10, 1 << 16, 1 << 20, 1 << 24)])
    assert fit.alpha_s == pytest.approx(1e-3)
    assert fit.beta_s_per_byte == pytest.approx(2e-9)
    assert fit.r_squared == pytest.approx(1.0)


def _rec(algorithm, size, t):
    return AllreduceRecord(algorithm=algorithm, size_bytes=size, world_size=4, median_s=t,
                           algbw_gbps=0, busbw_gbps=0, correct=True, iterations=5)


def test_crossover_is_the_smallest_size_from_which_ring_always_wins():
    records = [_rec("ring", 1, 5), _rec("tree", 1, 1), _rec("ring", 2, 1), _rec("tree", 2, 2),
               _rec("ring", 3, 3), _rec("tree", 3, 2), _rec("ring", 4, 1), _rec("tree", 4, 2),
               _rec("ring", 5, 1), _rec("tree", 5, 9)]
    assert crossover(records) == 4
    assert crossover([_rec("ring", 1, 5), _rec("tree", 1, 1)]) is None
