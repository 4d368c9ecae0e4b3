"""Atomic, asynchronous, verified checkpoints on fsspec storage; no Ray here.

The names below load their modules when first used (PEP 562), so that importing a torch-free
module of this package (`retention`, from the controller) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.checkpoint.store import LoadedCheckpoint, load_checkpoint, prune, write_checkpoint
    from elastic.checkpoint.writer import CheckpointWriter, WriteReport

__all__ = ["CheckpointWriter", "LoadedCheckpoint", "WriteReport", "load_checkpoint", "prune",
           "write_checkpoint"]

_WHERE = {"LoadedCheckpoint": "store", "load_checkpoint": "store", "prune": "store",
          "write_checkpoint": "store", "CheckpointWriter": "writer", "WriteReport": "writer"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"elastic.checkpoint.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'elastic.checkpoint' has no attribute {name!r}")
