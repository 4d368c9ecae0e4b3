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
                           algbw_gbps=0, busbw_gbps=0, correct=True, iterations=5,
                           transport="shm")


def test_crossover_is_the_smallest_size_from_which_ring_always_wins():
    records = [_rec("ring", 1, 5), _rec("tree", 1, 1), _rec("ring", 2, 1), _rec("tree", 2, 2),
               _rec("ring", 3, 3), _rec("tree", 3, 2), _rec("ring", 4, 1), _rec("tree", 4, 2),
               _rec("ring", 5, 1), _rec("tree", 5, 9)]
    assert crossover(records) == 4
    assert crossover([_rec("ring", 1, 5), _rec("tree", 1, 1)]) is None


def test_alpha_beta_fit_recovers_the_ring_model():
    from elastic.bench.scaling import fit_alpha_beta, project

    nbytes = 4_000_000
    alpha, beta = 2e-4, 1e-9
    samples = [(n, 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta) for n in (2, 3, 4, 8)]
    fitted = fit_alpha_beta(samples, nbytes)
    assert fitted == pytest.approx((alpha, beta), rel=1e-6)
    # One world size: all of it is charged to bandwidth.
    only = fit_alpha_beta([(2, 0.01), (2, 0.01)], nbytes)
    assert only[0] == 0.0 and only[1] == pytest.approx(0.01 / nbytes)
    # The projection: perfect scaling without communication, less with it.
    single = project(1, 256, 1e-3, 0.0, 0.0, nbytes)
    assert project(4, 256, 1e-3, 0.0, 0.0, nbytes) == pytest.approx(4 * single)
    assert project(4, 256, 1e-3, alpha, beta, nbytes) < 4 * project(1, 256, 1e-3, alpha, beta, nbytes)


def test_scaling_models_build_and_run_a_step():
    import torch

    from elastic.bench.scaling import MODELS, make_dataset, make_model

    for name in MODELS:
        model = make_model(name)
        x, y = make_dataset(name)[:4]
        torch.nn.functional.cross_entropy(model(x), y).backward()
