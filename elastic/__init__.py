"""elastic: elastic, fault-tolerant data-parallel training for PyTorch on Ray."""

from elastic.api import fit, kill, scale, status, stop
from elastic.config import (
    BatchConfig,
    ChaosEvent,
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
    "CollectiveConfig",
    "ElasticError",
    "FailureConfig",
    "FitConfig",
    "FitResult",
    "ScalingConfig",
    "TrainJob",
    "UserCodeError",
    "fit",
    "kill",
    "load_target",
    "scale",
    "status",
    "stop",
]
