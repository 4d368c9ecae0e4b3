"""Distributed evaluation and best-checkpoint retention in elastic.fit on a local Ray cluster,
against a plain single-process evaluation of the plain-PyTorch reference model."""

import json

import pytest

import elastic
from elastic import BatchConfig, CheckpointConfig, FitConfig, ScalingConfig
from elastic.checkpoint.store import MANIFEST, list_steps, step_dir_name
from elastic.config import EvaluationConfig
from elastic.events import CheckpointWritten, Evaluate
from tests.eval_jobs import eval_job, reference_metrics, reference_metrics_at
from tests.events import of_kind

pytestmark = pytest.mark.integration

B = 16


def _config(tmp_path, **kwargs) -> FitConfig:
    return FitConfig(scaling=ScalingConfig(num_workers=3, min_workers=1, max_workers=3),
                     batch=BatchConfig(global_batch_size=B, max_micro_batch=3),
                     run_dir=str(tmp_path / "run"), **kwargs)


def _assert_metrics(actual, expected):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert actual[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_evaluations_over_three_workers_match_one_process_at_every_evaluated_step(
        ray_cluster, tmp_path):
    config = _config(tmp_path, max_steps=10,
                     evaluation=EvaluationConfig(every_steps=4, batch_size=5))
    result = elastic.fit(eval_job(), config)
    assert result.steps == 10
    evaluations = of_kind(result.events, Evaluate)
    assert [e.step for e in evaluations] == [4, 8, 10]  # every 4 steps and at the end
    for event in evaluations:
        _assert_metrics(event.metrics, reference_metrics_at(0, B, event.step))
    _assert_metrics(evaluations[-1].metrics, reference_metrics(result.model_state))
    assert result.evaluation == evaluations[-1].metrics
    # Chunks end at the evaluated steps: training went on from there as without evaluation.
    assert [m["step"] for m in result.metrics] == list(range(10))


def test_the_kept_checkpoints_are_the_newest_plus_the_best_by_the_monitored_metric(
        ray_cluster, tmp_path):
    root = tmp_path / "ckpt"
    # mode 'max' on the error: the best are the earliest checkpoints, never the newest.
    checkpoint = CheckpointConfig(path=str(root), keep_last=2, monitor="mse", mode="max",
                                  keep_best=2)
    config = _config(tmp_path, max_steps=12, checkpoint=checkpoint,
                     evaluation=EvaluationConfig(every_steps=2))
    result = elastic.fit(eval_job(), config)
    values = {e.step: e.metrics["mse"] for e in of_kind(result.events, Evaluate)}
    assert list(values) == [2, 4, 6, 8, 10, 12]
    assert [e.step for e in of_kind(result.events, CheckpointWritten)] == list(values)
    best = sorted(values, key=lambda s: -values[s])[:2]
    assert set(list_steps(str(root))) == {12, 10} | set(best)
    for step in list_steps(str(root)):  # each one records the value its evaluation gave
        manifest = json.loads((root / step_dir_name(step) / MANIFEST).read_text())
        assert manifest["monitor"] == {"name": "mse", "value": values[step], "mode": "max"}
        loaded = elastic.load_checkpoint(str(root), step=step)
        _assert_metrics(reference_metrics(loaded.parts["model"]),
                        of_kind(result.events, Evaluate)[step // 2 - 1].metrics)
    assert elastic.load_checkpoint(str(root), best=True).step == best[0]
    assert elastic.load_checkpoint(str(root)).step == 12  # a resume takes the newest
