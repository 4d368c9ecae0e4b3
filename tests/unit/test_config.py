from datetime import timedelta

import pydantic
import pytest

from elastic.config import (
    BatchConfig,
    CheckpointConfig,
    CollectiveConfig,
    FitConfig,
    ScalingConfig,
    choose_backend,
)
from elastic.errors import ConfigError


def test_collective_config_defaults_are_auto():
    config = CollectiveConfig()
    assert config.backend == "auto"  # a FitConfig decides it; a communicator reads it as gloo
    assert config.algorithm == "auto"


@pytest.mark.parametrize(("use_gpu", "gpus", "nccl", "chosen"), [
    (False, 1.0, True, "gloo"),   # CPU workers
    (True, 1.0, True, "nccl"),    # a GPU each, NCCL installed
    (True, 2.0, True, "nccl"),    # several GPUs each (the first used)
    (True, 0.25, True, "gloo"),   # four workers share a GPU: NCCL refuses two ranks on one
    (True, 1.0, False, "gloo"),   # no cupy: the host plane
])
def test_auto_picks_nccl_only_for_gpu_workers_that_own_a_gpu_and_have_it(use_gpu, gpus, nccl,
                                                                          chosen):
    assert choose_backend(use_gpu, gpus, nccl) == chosen
    assert choose_backend(use_gpu, gpus, nccl, exact=True) == "gloo"  # sums on the host


def test_exact_mode_runs_gpu_workers_on_the_host_plane_and_refuses_nccl(monkeypatch):
    import elastic.config as module

    monkeypatch.setattr(module, "nccl_installed", lambda: True)
    batch = BatchConfig(global_batch_size=8, exact=True)
    config = FitConfig(scaling=ScalingConfig(num_workers=2, use_gpu=True), max_steps=1,
                       batch=batch)
    assert config.collective.backend == "gloo"  # 'auto', with a GPU each and NCCL installed
    shared = FitConfig(scaling=ScalingConfig(num_workers=4, use_gpu=True, gpus_per_worker=0.25),
                       max_steps=1, batch=batch, collective=CollectiveConfig(backend="gloo"))
    assert shared.batch.exact
    for use_gpu in (True, False):
        with pytest.raises(pydantic.ValidationError,
                           match=r"batch\.exact .*collective\.backend='nccl': set it to 'gloo'"):
            FitConfig(scaling=ScalingConfig(num_workers=2, use_gpu=use_gpu), max_steps=1,
                      batch=batch, collective=CollectiveConfig(
                          backend="nccl", nccl_simulator=not use_gpu))


def _fit(**scaling) -> FitConfig:
    return FitConfig(scaling=ScalingConfig(num_workers=2, **scaling), max_steps=1,
                     batch=BatchConfig(global_batch_size=8))


def test_a_fit_config_decides_auto_once_and_keeps_an_explicit_backend(monkeypatch):
    import elastic.config as module

    monkeypatch.setattr(module, "nccl_installed", lambda: True)
    config = _fit(use_gpu=True)
    assert config.collective.backend == "nccl" and config.collective.overlap_enabled
    shared = _fit(use_gpu=True, gpus_per_worker=0.5)
    # buckets overlap the backward pass on GPU workers, on the host plane too
    assert shared.collective.backend == "gloo" and shared.collective.overlap_enabled
    cpu = _fit()
    assert cpu.collective.backend == "gloo" and not cpu.collective.overlap_enabled  # CPU workers
    dumped = config.model_dump(mode="json")
    monkeypatch.setattr(module, "nccl_installed", lambda: False)
    assert FitConfig.model_validate(dumped).collective.backend == "nccl"  # as it was decided
    assert _fit(use_gpu=True).collective.backend == "gloo"
    explicit = FitConfig(scaling=ScalingConfig(num_workers=2, use_gpu=True), max_steps=1,
                         batch=BatchConfig(global_batch_size=8),
                         collective=CollectiveConfig(backend="nccl"))
    assert explicit.collective.backend == "nccl"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"backend": "mpi"}, "backend"),
        ({"algorithm": "butterfly"}, "algorithm"),
        ({"timeout": timedelta(0)}, "timeout"),
        ({"segment_bytes": 10}, "segment_bytes"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_collective_config_names_the_field(kwargs, field):
    with pytest.raises(pydantic.ValidationError) as info:
        CollectiveConfig(**kwargs)
    assert field in str(info.value)


def test_config_is_frozen():
    config = CollectiveConfig()
    with pytest.raises(pydantic.ValidationError):
        config.backend = "nccl"


def test_every_config_field_has_a_description():
    import elastic.config as module

    models = [
        obj for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, pydantic.BaseModel)
        and obj.__module__ == module.__name__ and not obj.__name__.startswith("_")
    ]
    assert models
    for model in models:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_chaos_raise_outside_user_code_is_refused():
    from elastic.config import ChaosEvent

    with pytest.raises(pydantic.ValidationError, match="user code only"):
        ChaosEvent(step=1, rank=0, action="raise", phase="allreduce")
    assert ChaosEvent(step=1, rank=0, action="raise", phase="backward").phase == "backward"


def test_batch_policies_are_checked_against_the_scaling():
    from elastic.config import BatchConfig, FitConfig, ScalingConfig

    with pytest.raises(pydantic.ValidationError, match=r"divisible by scaling\.num_workers"):
        FitConfig(scaling=ScalingConfig(num_workers=3), max_steps=1,
                  batch=BatchConfig(global_batch_size=16, policy="scale_with_workers"))
    with pytest.raises(pydantic.ValidationError, match=r"apply only with batch\.policy"):
        FitConfig(scaling=ScalingConfig(num_workers=2), max_steps=1,
                  batch=BatchConfig(global_batch_size=16, warmup_steps=5))
    with pytest.raises(pydantic.ValidationError, match="rebalance_threshold"):
        BatchConfig(global_batch_size=16, rebalance_threshold=1.5)
    ok = FitConfig(scaling=ScalingConfig(num_workers=2), max_steps=1,
                   batch=BatchConfig(global_batch_size=16, policy="scale_with_workers",
                                     lr_scaling="sqrt", warmup_steps=5))
    assert ok.batch.lr_scaling == "sqrt"


def test_chaos_oom_and_slow():
    from elastic.config import ChaosEvent

    with pytest.raises(pydantic.ValidationError, match="fires in user code only"):
        ChaosEvent(step=1, rank=0, action="oom", phase="optimizer")
    with pytest.raises(pydantic.ValidationError, match="factor"):
        ChaosEvent(step=1, rank=0, action="slow", factor=0.5)
    assert ChaosEvent(step=1, rank=0, action="slow", steps=None).steps is None
    assert ChaosEvent(step=1, rank=0, action="oom", phase="restore").phase == "restore"
    for action in ("kill", "raise", "hang"):
        with pytest.raises(pydantic.ValidationError, match="'restore' takes action 'oom' only"):
            ChaosEvent(step=1, rank=0, action=action, phase="restore")


def test_a_chaos_rank_the_run_never_has_is_refused_naming_the_setting():
    from elastic.config import BatchConfig, ChaosEvent, FitConfig, ScalingConfig

    def config(scaling, *ranks):
        return FitConfig(scaling=scaling, batch=BatchConfig(global_batch_size=8), max_steps=4,
                         chaos=tuple(ChaosEvent(step=1, rank=r, action="kill") for r in ranks))

    with pytest.raises(pydantic.ValidationError, match=r"rank 2 at step 1\): the run has at most 2 "
                       r"workers \(scaling\.max_workers"):
        config(ScalingConfig(num_workers=2), 1, 2)
    with pytest.raises(pydantic.ValidationError, match=r"at most 3 workers.*raise scaling\.max_workers"):
        config(ScalingConfig(num_workers=2, max_workers=3), 3)
    # A rank above the start's workers that a run grown to max_workers has.
    assert config(ScalingConfig(num_workers=2, max_workers=3), 0, 2).chaos[1].rank == 2


# --- a job's settings (TrainJob.settings, FitConfig.for_job) -----------------------------------


def _job_with(settings):
    import torch

    from elastic import TrainJob

    return TrainJob(model=lambda: torch.nn.Linear(1, 1), optimizer=torch.optim.SGD,
                    loss=lambda m, b: m(b).sum(), dataset=lambda: [0.0], settings=settings,
                    source="the adapter")


def _base(**fields):
    from elastic import BatchConfig, FitConfig, ScalingConfig

    return FitConfig(scaling=ScalingConfig(num_workers=2), batch=BatchConfig(global_batch_size=4),
                     max_steps=3, **fields)


def test_a_setting_is_compared_as_the_configuration_holds_it():
    from elastic.config import with_job_settings

    config = _base(collective=CollectiveConfig(timeout=timedelta(seconds=30)))
    same = with_job_settings(config, {"collective.timeout": 30}, "the adapter")
    assert same.collective.timeout == timedelta(seconds=30)
    with pytest.raises(ConfigError, match=r"implies collective.timeout=40"):
        with_job_settings(config, {"collective.timeout": 40}, "the adapter")


def test_a_setting_under_a_section_left_out_fills_it_and_a_bad_result_names_the_source():
    from elastic.config import with_job_settings

    config = _base()  # checkpoint=None
    with pytest.raises(ConfigError, match=r"the configuration with what the adapter implies .* "
                                          r"is invalid: checkpoint.path: Field required"):
        with_job_settings(config, {"checkpoint.every_steps": 5}, "the adapter")
    filled = with_job_settings(config, {"checkpoint.every_steps": 5, "checkpoint.path": "/tmp/c"},
                               "the adapter")
    assert (filled.checkpoint.every_steps, filled.checkpoint.path) == (5, "/tmp/c")


def test_for_job_fills_what_the_fields_leave_out():
    from elastic import FitConfig, ScalingConfig

    job = _job_with({"epochs": 2, "batch.global_batch_size": 8})
    config = FitConfig.for_job(job, scaling=ScalingConfig(num_workers=2))
    assert (config.epochs, config.batch.global_batch_size, config.max_steps) == (2, 8, None)


def test_pinning_batches_that_no_gpu_takes_is_refused():
    from elastic.config import DataConfig

    with pytest.raises(pydantic.ValidationError, match=r"scaling\.use_gpu"):
        FitConfig(scaling=ScalingConfig(num_workers=1), max_steps=1,
                  batch=BatchConfig(global_batch_size=8),
                  data=DataConfig(pin_memory=True, loader_workers=2))


def test_a_relative_checkpoint_folder_or_key_is_made_absolute_where_the_config_is_built(
        tmp_path, monkeypatch):
    # The controller and the workers open it in other processes (on a cluster, in the
    # directory `ray start` ran in): "ckpt" was another folder there, and `resume` looked
    # under the run's starting directory.
    from elastic.api import run_dir_of

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    config = CheckpointConfig(path="ckpt", key_file="keys/k.key")
    assert (config.path, config.key_file) == (str(tmp_path / "ckpt"), str(tmp_path / "keys/k.key"))
    assert CheckpointConfig(path="~/ckpt").path == str(tmp_path / "me" / "ckpt")
    for url in ("s3://bucket/ckpt", "memory://ckpt", "file:///abs/ckpt"):
        assert CheckpointConfig(path=url).path == url
    assert run_dir_of("~/runs/r1", "r1") == str(tmp_path / "me" / "runs" / "r1")


def test_a_checkpoint_folder_without_an_interval_is_written_every_30_minutes():
    # Before: only the final checkpoint, so a run that lost every worker or its driver had
    # nothing to go back to, whatever --checkpoint's help promised.
    from elastic.config import DEFAULT_CHECKPOINT_EVERY_S

    assert DEFAULT_CHECKPOINT_EVERY_S == 1800
    assert CheckpointConfig(path="/ckpt").every_seconds == 1800
    assert CheckpointConfig(path="/ckpt", every_steps=5).every_seconds is None
    assert CheckpointConfig(path="/ckpt", every_seconds=60).every_seconds == 60
    # Both given as None: the final checkpoint only (as a resumed run's recorded config has).
    final_only = CheckpointConfig(path="/ckpt", every_steps=None, every_seconds=None)
    assert (final_only.every_steps, final_only.every_seconds) == (None, None)
    assert CheckpointConfig.model_validate(final_only.model_dump()).every_seconds is None
