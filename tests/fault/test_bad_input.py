"""Bad input, as a table: each row is one invalid configuration or target and gives one clear
error naming what to fix; nothing is half-started and no actor is left behind."""

from __future__ import annotations

import functools
import threading
from datetime import timedelta

import pydantic
import pytest
import ray
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastic
from elastic import BatchConfig, ChaosEvent, CheckpointConfig, FitConfig, ScalingConfig
from elastic.config import CollectiveConfig, FailureConfig
from elastic.errors import ConfigError
from tests.jobs import make_dataset, make_model, make_optimizer, mse, regression_job

pytestmark = pytest.mark.fault

SCALING = ScalingConfig(num_workers=2)
BATCH = BatchConfig(global_batch_size=16)


def fit_config(**kwargs) -> FitConfig:
    return FitConfig(**{"scaling": SCALING, "batch": BATCH, "max_steps": 4, **kwargs})


def _raises():
    raise RuntimeError("the data set is not there")


def _sparse_model():
    return nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True), nn.Linear(4, 1))


def _not_a_module():
    return "a model"


def _not_an_optimizer(params):
    return [p for p in params]


def _not_a_dataset():
    return 42


def _tiny_dataset():
    x = torch.zeros(8, 6, dtype=torch.float64)
    return TensorDataset(x, x[:, :1])


_LOCK = threading.Lock()


def _dataset_behind_a_lock():  # reaches a module-level lock: the factory cannot be pickled
    with _LOCK:
        return make_dataset()


def job(**replace) -> elastic.TrainJob:
    base = {"model": make_model, "optimizer": make_optimizer, "loss": mse, "dataset": make_dataset}
    return elastic.TrainJob(**{**base, **replace})


# (id, what to call, error type, text the message must contain)
CONFIG_ROWS = [
    ("zero workers", lambda: ScalingConfig(num_workers=0), pydantic.ValidationError, "num_workers"),
    ("negative workers", lambda: ScalingConfig(num_workers=-2), pydantic.ValidationError, "num_workers"),
    ("min above max", lambda: ScalingConfig(num_workers=2, min_workers=3, max_workers=2),
     pydantic.ValidationError, "lower scaling.min_workers"),
    ("num outside bounds", lambda: ScalingConfig(num_workers=5, max_workers=4),
     pydantic.ValidationError, "change scaling.num_workers"),
    ("zero cpus per worker", lambda: ScalingConfig(num_workers=1, cpus_per_worker=0),
     pydantic.ValidationError, "cpus_per_worker"),
    ("zero global batch", lambda: BatchConfig(global_batch_size=0), pydantic.ValidationError,
     "global_batch_size"),
    ("zero micro-batch", lambda: BatchConfig(global_batch_size=8, max_micro_batch=0),
     pydantic.ValidationError, "max_micro_batch"),
    ("no end", lambda: FitConfig(scaling=SCALING, batch=BATCH), pydantic.ValidationError,
     "set epochs or max_steps"),
    ("zero epochs", lambda: fit_config(epochs=0), pydantic.ValidationError, "epochs"),
    ("unknown backend", lambda: CollectiveConfig(backend="mpi"), pydantic.ValidationError, "backend"),
    ("unknown algorithm", lambda: CollectiveConfig(algorithm="butterfly"), pydantic.ValidationError,
     "algorithm"),
    ("zero timeout", lambda: CollectiveConfig(timeout=timedelta(0)), pydantic.ValidationError, "timeout"),
    ("shared gpu on nccl",
     lambda: fit_config(scaling=ScalingConfig(num_workers=2, use_gpu=True, gpus_per_worker=0.5),
                        collective=CollectiveConfig(backend="nccl")),
     pydantic.ValidationError, "set collective.backend='gloo'"),
    ("nccl without gpu", lambda: fit_config(collective=CollectiveConfig(backend="nccl")),
     pydantic.ValidationError, "needs scaling.use_gpu=True"),
    ("exact with groups off",
     lambda: fit_config(batch=BatchConfig(global_batch_size=8, exact=True, groups="off")),
     pydantic.ValidationError, "cannot run with batch.groups 'off'"),
    ("bad run name", lambda: fit_config(name="my run!"), pydantic.ValidationError, "name"),
    ("unknown setting", lambda: BatchConfig(global_batch_size=8, global_batchsize=9),
     pydantic.ValidationError, "global_batchsize"),
    ("zero checkpoint interval", lambda: CheckpointConfig(path="x", every_steps=0),
     pydantic.ValidationError, "every_steps"),
    ("raise in the optimizer phase", lambda: ChaosEvent(step=1, rank=0, action="raise", phase="optimizer"),
     pydantic.ValidationError, "fires in user code only"),
    ("batch not divisible for scale_with_workers",
     lambda: fit_config(scaling=ScalingConfig(num_workers=3),
                        batch=BatchConfig(global_batch_size=16, policy="scale_with_workers")),
     pydantic.ValidationError, "divisible by scaling.num_workers"),
    ("negative retries", lambda: FailureConfig(max_user_retries=-1), pydantic.ValidationError,
     "max_user_retries"),
    ("model instance instead of a factory", lambda: job(model=make_model()), ConfigError,
     "TrainJob.model must be a factory"),
    ("loss not callable", lambda: job(loss="mse"), ConfigError, "TrainJob.loss must be callable"),
]

# Rows that reach the cluster: they must fail cleanly there.
RUN_ROWS = [
    ("dataset factory raises", lambda: job(dataset=_raises), fit_config(), ConfigError,
     "could not build the job"),
    ("model factory returns the wrong type", lambda: job(model=_not_a_module), fit_config(),
     ConfigError, "not a torch.nn.Module"),
    ("a layer with sparse gradients", lambda: job(model=_sparse_model), fit_config(),
     ConfigError, "'0' make sparse gradients (sparse=True), which elastic does not support"),
    ("optimizer factory returns the wrong type", lambda: job(optimizer=_not_an_optimizer),
     fit_config(), ConfigError, "not a torch.optim.Optimizer"),
    ("dataset factory returns no dataset", lambda: job(dataset=_not_a_dataset), fit_config(),
     ConfigError, "not a map-style dataset"),
    ("global batch above the data set", lambda: job(dataset=_tiny_dataset), fit_config(),
     ConfigError, "fewer than one global batch"),
    ("batch at max_workers above the data set", regression_job,
     fit_config(scaling=ScalingConfig(num_workers=2, max_workers=16),
                batch=BatchConfig(global_batch_size=16, policy="scale_with_workers")),
     ConfigError, "lower batch.global_batch_size or scaling.max_workers"),
    ("checkpoint path is a file", regression_job, "FILE", ConfigError, "is a file, not a directory"),
    ("a factory that cannot be pickled", lambda: job(dataset=_dataset_behind_a_lock), fit_config(),
     ConfigError, "TrainJob.dataset cannot be sent to the workers: _dataset_behind_a_lock -> "
     "global '_LOCK' is a _thread.lock that cannot be pickled"),
    ("checkpoint URL with an unknown protocol", regression_job,
     fit_config(checkpoint=CheckpointConfig(path="nosuchfs://bucket/x")), ConfigError,
     "cannot be used"),
]


@pytest.mark.parametrize(("make", "error", "text"), [r[1:] for r in CONFIG_ROWS],
                         ids=[r[0] for r in CONFIG_ROWS])
def test_invalid_configuration_gives_one_clear_error(make, error, text):
    with pytest.raises(error) as info:
        make()
    assert text in str(info.value)


def _alive_actors() -> list[str]:
    from ray._private import state

    return sorted(a["ActorClassName"] for a in state.actors().values() if a["State"] != "DEAD")


def _wait_no_actors() -> list[str]:
    done = threading.Event()
    timer = threading.Timer(30.0, done.set)
    timer.start()
    try:
        while (alive := _alive_actors()) and not done.is_set():
            done.wait(0.05)
        return alive
    finally:
        timer.cancel()


@pytest.mark.parametrize(("make_job", "config", "error", "text"), [r[1:] for r in RUN_ROWS],
                         ids=[r[0] for r in RUN_ROWS])
def test_invalid_job_fails_cleanly_and_leaves_no_actor(ray_cluster, tmp_path, make_job, config,
                                                      error, text):
    assert _wait_no_actors() == []
    if config == "FILE":
        path = tmp_path / "not-a-dir"
        path.write_text("x")
        config = fit_config(checkpoint=CheckpointConfig(path=str(path)))
    config = config.model_copy(update={"run_dir": str(tmp_path / "run")})
    with pytest.raises(error) as info:
        elastic.fit(make_job(), config)
    assert text in str(info.value)
    assert len(str(info.value).splitlines()) == 1
    assert _wait_no_actors() == []


def test_fit_refuses_something_that_is_not_a_train_job():
    with pytest.raises(TypeError, match=r"needs an elastic\.TrainJob"):
        elastic.fit(nn.Linear(2, 2), fit_config())


def test_unknown_targets_are_refused_by_name():
    with pytest.raises(ConfigError, match="does not exist"):
        elastic.load_target("no/such/file.py:job")
    with pytest.raises(ConfigError, match="must look like"):
        elastic.load_target("examples/spirals.py")


assert len(CONFIG_ROWS) + len(RUN_ROWS) >= 20
_ = functools, ray
