"""Atomic, asynchronous, verified checkpoints on fsspec storage; no Ray here."""

from elastic.checkpoint.store import LoadedCheckpoint, load_checkpoint, prune, write_checkpoint
from elastic.checkpoint.writer import CheckpointWriter, WriteReport

__all__ = ["CheckpointWriter", "LoadedCheckpoint", "WriteReport", "load_checkpoint", "prune",
           "write_checkpoint"]
