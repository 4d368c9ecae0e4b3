"""elastic: elastic, fault-tolerant data-parallel training for PyTorch on Ray."""

from elastic.api import events, fit, kill, load_checkpoint, runs, scale, start, status, stop
from elastic.config import (
    BatchConfig,
    ChaosEvent,
    CheckpointConfig,
    CollectiveConfig,
    FailureConfig,
    FitConfig,
    ScalingConfig,
)
from elastic.errors import ElasticError, UserCodeError
from elastic.job import TrainJob
from elastic.result import FitResult
from elastic.targets import load_target

__all__ = [
    "BatchConfig",
    "ChaosEvent",
    "CheckpointConfig",
    "CollectiveConfig",
    "ElasticError",
    "FailureConfig",
    "FitConfig",
    "FitResult",
    "ScalingConfig",
    "TrainJob",
    "UserCodeError",
    "events",
    "fit",
    "kill",
    "load_checkpoint",
    "load_target",
    "runs",
    "scale",
    "start",
    "status",
    "stop",
]
