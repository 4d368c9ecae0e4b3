"""elastic: elastic, fault-tolerant data-parallel training for PyTorch on Ray."""

from elastic.adapt.groups import forward_seed
from elastic.api import (
    connect,
    drain,
    events,
    fit,
    kill,
    load_checkpoint,
    resume,
    runs,
    scale,
    start,
    status,
    stop,
)
from elastic.callbacks import Callback, EarlyStopping, StopRun
from elastic.config import (
    BatchConfig,
    ChaosEvent,
    CheckpointConfig,
    CollectiveConfig,
    DataConfig,
    EvaluationConfig,
    FailureConfig,
    FitConfig,
    LoggingConfig,
    MLflowConfig,
    ScalingConfig,
    ShardingConfig,
    TrainingConfig,
)
from elastic.errors import AfterStepError, ElasticError, UserCodeError
from elastic.job import TrainJob
from elastic.targets import load_target
from elastic.trainer.loss import LossSum


def __getattr__(name: str):
    # FitResult needs torch; importing it lazily keeps `import elastic` (and so the control
    # commands of the CLI) free of torch's import time.
    if name == "FitResult":
        from elastic.result import FitResult

        return FitResult
    raise AttributeError(f"module 'elastic' has no attribute {name!r}")

__all__ = [
    "AfterStepError",
    "BatchConfig",
    "Callback",
    "ChaosEvent",
    "CheckpointConfig",
    "CollectiveConfig",
    "DataConfig",
    "EarlyStopping",
    "ElasticError",
    "EvaluationConfig",
    "FailureConfig",
    "FitConfig",
    "FitResult",
    "LoggingConfig",
    "LossSum",
    "MLflowConfig",
    "ScalingConfig",
    "ShardingConfig",
    "StopRun",
    "TrainJob",
    "TrainingConfig",
    "UserCodeError",
    "connect",
    "drain",
    "events",
    "fit",
    "forward_seed",
    "kill",
    "load_checkpoint",
    "load_target",
    "resume",
    "runs",
    "scale",
    "start",
    "status",
    "stop",
]
