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


def test_the_adapt_bench_sorts_steps_by_the_shares_they_ran_with():
    # The re-split is decided at step 4, but the chunk handed out ahead (steps 4-7) ran on
    # the even split: before, its steps counted as rebalanced ones.
    from elastic.bench.adapt import split_by_shares

    shares = [[8, 8]] * 8 + [[12, 4]] * 4
    metrics = [{"step": s, "shares": shares[s], "step_time_s": 2.0 if s < 8 else 1.0}
               for s in range(12)]
    even, after = split_by_shares(metrics)
    assert even == [2.0] * 7 and after == [1.0] * 4
    assert split_by_shares(metrics[:8]) == ([2.0] * 7, [])


def test_bench_arguments_the_data_cannot_hold_are_refused_before_any_run():
    from elastic.bench.overhead import SAMPLES, run_overhead_bench

    with pytest.raises(ValueError, match=f"--batch must be between 1 and the data set's {SAMPLES}"):
        run_overhead_bench(workers=2, global_batch_size=2 * SAMPLES)


def test_the_memcpy_ceiling_is_one_threads_and_leaves_torch_as_it_was():
    import torch

    from elastic.bench import allreduce

    threads, seen = torch.get_num_threads(), []
    real = torch.Tensor.copy_

    def copy(self, src, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, src, *args, **kwargs)

    try:
        torch.Tensor.copy_ = copy
        assert allreduce.measure_memcpy_gbps(1 << 20) > 0
    finally:
        torch.Tensor.copy_ = real
    assert seen == [1] * 5 and torch.get_num_threads() == threads
