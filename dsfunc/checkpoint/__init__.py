"""Checkpoints of a :class:`~dsfunc.TrainState`: atomic, resharding saves and loads, and fp32 export."""

from dsfunc.checkpoint.api import (
    META_FILE,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    available_tags,
    export_fp32,
    load_checkpoint,
    save_checkpoint,
    wait_for_checkpoint,
)

__all__ = [
    "META_FILE",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "available_tags",
    "export_fp32",
    "load_checkpoint",
    "save_checkpoint",
    "wait_for_checkpoint",
]
