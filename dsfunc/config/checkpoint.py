"""The ``checkpoint`` section: how a save checks that every rank gave the same tag."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import _only
from dsfunc.config.errors import _bad
from dsfunc.config.schema import _key, _section

TAG_VALIDATION_MODES = ("IGNORE", "WARN", "FAIL")


def _mode(value: Any, path: str) -> str:
    """One of :data:`TAG_VALIDATION_MODES`, in any case (DeepSpeed upper-cases it)."""
    if isinstance(value, str) and value.upper() in TAG_VALIDATION_MODES:
        return value.upper()
    raise _bad(path, value, '"Ignore", "Warn" or "Fail" (any case)')


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: DeepSpeed's checkpoint options; dsfunc implements ``tag_validation``."""

    tag_validation: str = _key("WARN", _mode)
    """What a save does when the ranks give different tags: "FAIL" raises on every rank (an
    ``AssertionError`` too, as in DeepSpeed); "WARN" (the default) logs which rank gave which tag and "IGNORE"
    says nothing, and both save under rank 0's tag, where DeepSpeed writes each rank's files under its own
    tag (a checkpoint no tag holds whole). A load always needs the same tag on every rank.
    """


_FIXED = {
    "load_universal": _only(False, feature="these checkpoint options",
                            fix="dsfunc checkpoints load at any world size without conversion."),
    "use_node_local_storage": _only(False, feature="node-local checkpoint storage"),
    "parallel_write": _only({"pipeline_stage": False}, feature="parallel pipeline-stage writes"),
    "checkpoint_serialization": _only(True, feature="these checkpoint options"),
    "writer": _only(None, feature="DeepSpeed's checkpoint writers"),
}

_checkpoint = _section(CheckpointConfig, _FIXED)
