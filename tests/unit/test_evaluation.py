"""Distributed evaluation on the worker side, without Ray: ranks as threads of the test process
over real communicators, against a plain single-process evaluation written here."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from elastic import LossSum
from elastic.collective import RendezvousServer
from elastic.config import CollectiveConfig
from elastic.trainer.evaluation import (
    EvalFailure,
    LazyDataset,
    eval_slices,
    evaluate_share,
    judge,
    metric_terms,
)
from tests.threads import run_ranks

N = 23
SEED = 5


@pytest.fixture(scope="module")
def server():
    srv = RendezvousServer()
    yield srv
    srv.close()


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = torch.randn(N, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def _model() -> nn.Module:
    torch.manual_seed(11)
    # Dropout: a forward in training mode would not be the reference's.
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 1)).double()


def _eval_step(model, batch):
    x, y = batch
    err = model(x) - y
    return {"mse": ((err ** 2).sum(), err.numel()),
            "mae": LossSum(err.abs().sum(), torch.tensor(len(x))),
            "positive": ((model(x) > 0).sum(), len(x))}


def _reference(model: nn.Module) -> dict[str, float]:
    """One process, the whole set at once, written without project code."""
    x, y = _data().tensors
    model.eval()
    with torch.no_grad():
        out = model(x)
    err = out - y
    return {"mse": float((err ** 2).sum() / err.numel()), "mae": float(err.abs().sum() / N),
            "positive": int((out > 0).sum()) / N}


def _evaluate(server, shares, *, batch_size=4, eval_step=_eval_step, factory=_data,
              factories=None, shared_memory=True):
    """Every rank evaluates its share of a fresh model; returns each rank's result."""
    model = _model()

    def body(comm):
        replica = _model()
        replica.load_state_dict(model.state_dict())
        dataset = LazyDataset(factories[comm.rank] if factories else factory, SEED)
        return evaluate_share(comm, replica, dataset, default_collate, eval_step, shares,
                              batch_size, SEED)

    config = CollectiveConfig(shared_memory=shared_memory)
    return model, run_ranks(server, len(shares), body, config)


def test_slices_follow_the_plan_and_cover_the_set_once():
    assert eval_slices(23, (5, 0, 2)) == [range(0, 16), range(16, 16), range(16, 23)]
    assert eval_slices(10, (1, 1, 1)) == [range(0, 4), range(4, 7), range(7, 10)]
    assert eval_slices(2, (4, 4, 4)) == [range(0, 1), range(1, 2), range(2, 2)]
    assert eval_slices(0, (3, 1)) == [range(0, 0), range(0, 0)]
    for size in range(40):
        slices = eval_slices(size, (3, 0, 7, 1))
        assert [i for s in slices for i in s] == list(range(size))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("shares", [(5, 0, 2), (1, 1, 1), (7, 1, 3)])
def test_three_ranks_give_the_single_process_metrics_on_every_rank(server, shares, shared_memory):
    model, results = _evaluate(server, shares, shared_memory=shared_memory)
    assert all(isinstance(r, dict) for r in results)
    assert results[1] == results[0] and results[2] == results[0]  # the same bits everywhere
    expected = _reference(model)
    assert results[0].keys() == expected.keys()
    for name, value in expected.items():
        assert math.isclose(results[0][name], value, rel_tol=1e-12, abs_tol=1e-14), name


@pytest.mark.timeout(60)
def test_a_set_smaller_than_the_world_leaves_a_rank_without_samples(server):
    small = lambda: TensorDataset(*(t[:2] for t in _data().tensors))  # noqa: E731
    model, results = _evaluate(server, (1, 1, 1), factory=small)
    x, y = small().tensors
    model.eval()
    with torch.no_grad():
        expected = float(((model(x) - y) ** 2).mean())
    assert results[0] == results[1] == results[2]
    assert math.isclose(results[2]["mse"], expected, rel_tol=1e-12)


@pytest.mark.timeout(60)
def test_an_empty_set_gives_no_metrics(server):
    empty = lambda: TensorDataset(torch.zeros(0, 4), torch.zeros(0, 1))  # noqa: E731
    _, results = _evaluate(server, (2, 1), factory=empty)
    assert results == [{}, {}]


class _Broken(torch.utils.data.Dataset):
    """The evaluation set with sample 20 unreadable (it lies in the last rank's slice)."""

    def __init__(self):
        self.data = _data()

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i == 20:
            raise ValueError("sample 20 is corrupt")
        return self.data[i]


@pytest.mark.timeout(60)
def test_a_user_error_on_one_rank_reaches_every_rank_without_a_hang(server):
    _, results = _evaluate(server, (5, 0, 2), factory=_Broken)
    assert all(isinstance(r, EvalFailure) for r in results)
    assert {r.ranks for r in results} == {(2,)}
    assert "sample 20 is corrupt" in results[2].traceback
    assert results[0].traceback is None and results[1].traceback is None


@pytest.mark.timeout(60)
def test_an_eval_step_that_raises_on_two_ranks_names_both(server):
    def step(model, batch):
        if batch[0].shape[0] < 4:
            raise RuntimeError("short batch")
        return _eval_step(model, batch)

    # Slices of 8, 6 and 9 samples in batches of 4: the last batches of ranks 1 and 2 are short.
    assert [len(s) for s in eval_slices(N, (8, 6, 9))] == [8, 6, 9]
    _, results = _evaluate(server, (8, 6, 9), eval_step=step)
    assert all(isinstance(r, EvalFailure) for r in results)
    assert [r.ranks for r in results] == [(1, 2)] * 3
    assert results[0].traceback is None and "short batch" in results[1].traceback


@pytest.mark.timeout(60)
def test_ranks_whose_metric_names_differ_all_fail_the_same_way(server):
    def step(model, batch):
        x, y, tag = batch
        name = "first" if int(tag[0]) == 0 else "second"
        return {name: ((model(x) - y).sum(), len(x))}

    tags = (torch.arange(N) >= 12).long()  # rank 0's slice is [0, 12), rank 1's [12, 23)
    factory = lambda: TensorDataset(*_data().tensors, tags)  # noqa: E731
    _, results = _evaluate(server, (1, 1), eval_step=step, factory=factory)
    assert [r.ranks for r in results] == [(0, 1), (0, 1)]
    assert results[0].traceback == results[1].traceback
    assert "different metric names" in results[0].traceback


@pytest.mark.timeout(60)
def test_batches_of_one_rank_whose_names_differ_are_its_user_error(server):
    def step(model, batch):
        x, y, tag = batch
        return {f"tag{int(tag[0])}": ((model(x) - y).sum(), len(x))}

    tags = (torch.arange(N) >= 20).long()  # only rank 1's slice [12, 23) holds both tags
    factory = lambda: TensorDataset(*_data().tensors, tags)  # noqa: E731
    _, results = _evaluate(server, (1, 1), eval_step=step, factory=factory)
    assert [r.ranks for r in results] == [(1,), (1,)]
    assert "every batch must return the same names" in results[1].traceback


@pytest.mark.timeout(60)
def test_evaluation_sets_of_different_sizes_fail_on_every_rank(server):
    short = lambda: TensorDataset(*(t[:20] for t in _data().tensors))  # noqa: E731
    _, results = _evaluate(server, (1, 1, 1), factories=[_data, short, _data])
    assert all(isinstance(r, EvalFailure) for r in results)
    assert results[0].traceback == results[1].traceback == results[2].traceback
    assert "different sizes" in results[0].traceback


@pytest.mark.timeout(60)
def test_evaluation_leaves_the_generators_and_the_modules_modes_as_they_were(server):
    model = _model()
    model.train()
    model[2].eval()  # a module the user keeps in eval mode
    torch.manual_seed(123)
    random.seed(4)
    np.random.seed(5)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())

    def body(comm):
        return evaluate_share(comm, model, LazyDataset(_data, SEED), default_collate, _eval_step,
                              (1,), 5, SEED)

    [result] = run_ranks(server, 1, body)
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
    assert [m.training for m in model.modules()] == [True, True, True, False, True]
    assert result == pytest.approx(_reference(_model()), rel=1e-12)


def test_what_eval_step_returns_is_checked():
    assert metric_terms({"a": (torch.tensor(2.0), 4), "b": LossSum(torch.tensor([3.0]), 2)}) == {
        "a": (2.0, 4.0), "b": (3.0, 2.0)}
    with pytest.raises(TypeError, match="return a dict"):
        metric_terms(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"\(sum, count\)"):
        metric_terms({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="one-element tensor"):
        metric_terms({"a": (torch.ones(3), 3)})


def test_the_verdict_is_a_function_of_the_summed_header():
    def row(error=0.0, names=2.0, hashed=9.0, nbytes=5.0, size=23.0):
        return [error, names, hashed, nbytes, size]

    clean = judge(row() + row(names=0, hashed=0, nbytes=0) + row(), 1, None)
    assert (clean.failure, clean.names_from, clean.num_names, clean.share_names) == (None, 0, 2, True)
    failed = judge(row() + row(error=1.0) + row(), 1, "trace")
    assert failed.failure == EvalFailure((1,), "trace")
    assert judge(row() + row(error=1.0), 0, None).failure == EvalFailure((1,), None)
    differ = judge(row() + row(hashed=8.0), 0, None).failure
    assert differ is not None and differ.ranks == (0, 1)
    assert judge(row(names=0, hashed=0, nbytes=0) * 2, 0, None).names_from == -1


def _autocast_seen(model: nn.Module, batch) -> dict:
    x, y = batch
    enabled = torch.is_autocast_enabled("cpu")
    out = model(x.float())
    return {"autocast": (float(enabled) * len(y), len(y)),
            "bf16": (float(out.dtype == torch.bfloat16) * len(y), len(y))}


@pytest.mark.parametrize(("precision", "expected"), [("bf16-mixed", 1.0), ("32", 0.0)])
def test_evaluation_runs_under_the_runs_mixed_precision(tmp_path, precision, expected):
    """As the training forward, and as Lightning and the Hugging Face Trainer evaluate."""
    from elastic import BatchConfig, FitConfig, ScalingConfig, TrainJob
    from elastic.config import TrainingConfig
    from elastic.trainer.evaluation import evaluate_slice
    from elastic.trainer.replica import Replica

    job = TrainJob(model=lambda: nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                   loss=lambda m, b: m(b[0]).sum(), dataset=_data, eval_dataset=_data,
                   eval_step=_autocast_seen)
    config = FitConfig(scaling=ScalingConfig(num_workers=1), max_steps=1, run_dir=str(tmp_path),
                       batch=BatchConfig(global_batch_size=4),
                       training=TrainingConfig(precision=precision))
    replica = Replica(job, config, str(tmp_path))
    sums = evaluate_slice(replica.model, _data(), default_collate, replica.eval_step,
                          range(0, 8), 4, SEED)
    assert sums == {"autocast": [8 * expected, 8.0], "bf16": [8 * expected, 8.0]}
