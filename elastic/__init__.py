"""elastic: elastic, fault-tolerant data-parallel training for PyTorch on Ray."""

from elastic.config import CollectiveConfig
from elastic.errors import ElasticError

__all__ = ["CollectiveConfig", "ElasticError"]
