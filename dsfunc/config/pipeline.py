"""The ``pipeline`` section: pipeline parallelism (:mod:`dsfunc.pipeline`).

DeepSpeed's section holds ``stages`` (``"auto"``: the ``PipelineModule``'s ``num_stages``), ``partition``,
``seed_layers``, ``activation_checkpoint_interval``, ``pipe_partitioned`` and ``grad_partitioned``; dsfunc
reads ``stages`` and ``activation_checkpoint_interval`` and adds ``schedule`` and ``partition_method``.
The batch triple is resolved against the data-parallel ranks of a stage (``world_size / stages``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import _accepted, _bool, _integer, _only, _optional, _string
from dsfunc.config.errors import _bad
from dsfunc.config.schema import _key, _section

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


def _schedule(value: Any, path: str) -> str:
    for name in SCHEDULES:
        if isinstance(value, str) and value.lower() == name.lower():
            return name
    raise _bad(path, value, "one of " + ", ".join(f'"{s}"' for s in SCHEDULES) + " (case-insensitive)")


def _partition_method(value: Any, path: str) -> str:
    text = _string(value, path)
    if text.lower() in ("parameters", "uniform") or text.lower().startswith("type:"):
        return text
    raise _bad(path, value, '"parameters", "uniform" or "type:<layer class regex>"')


@dataclass(frozen=True)
class PipelineConfig:
    """``pipeline``: how many stages the layers are split over, and the schedule that runs them."""

    stages: int | None = _key(None, _optional(_integer(ge=1)))
    """Pipeline stages; the world splits into stages / stages_per_rank ranks x data-parallel replicas (world_size
    must divide). Unset (or DeepSpeed's "auto"): the PipelineModule's num_stages, or no pipeline for init_state.
    """
    schedule: str = _key("1F1B", _schedule)
    """The torch.distributed.pipelining schedule of one step's micro-batches: "1F1B" (DeepSpeed's, the default),
    "GPipe", or "Interleaved1F1B" (several stages per rank: stages_per_rank). A dsfunc key.
    """
    stages_per_rank: int = _key(1, _integer(ge=1))
    """Stages each pipeline rank holds, for "Interleaved1F1B": rank r holds stages r, r + R, ... of stages = R x
    stages_per_rank (R ranks per replica). A dsfunc key.
    """
    partition_method: str = _key("parameters", _partition_method)
    """How init_state splits the layers: "parameters" (balance trainable parameters), "uniform" (balance layer
    counts) or "type:<regex>" (balance layers whose class matches). A dsfunc key (PipelineModule's argument).
    """
    seed_layers: bool = _key(False, _bool)
    """Seed each layer's initialisation with base seed + its index (layers built from LayerSpecs)."""
    activation_checkpoint_interval: int = _key(0, _integer(ge=0))
    """Recompute every run of this many layers in backward (0: off), as PipelineModule's argument."""


_NO_TENSOR_PARALLELISM = "partitioning pipeline activations over tensor-parallel ranks (dsfunc has none)"
_FIXED = {
    "partition": _only("best", "parameters", "uniform", feature="this partition key",
                       fix='Use "partition_method" instead.'),
    "pipe_partitioned": _only(True, False, feature=_NO_TENSOR_PARALLELISM),
    "grad_partitioned": _only(True, False, feature=_NO_TENSOR_PARALLELISM),
    "use_reentrant": _accepted(_optional(_bool)),  # PIPELINE_WITHOUT_EFFECT
}
_check = _section(PipelineConfig, _FIXED)

# pipeline keys that choose between DeepSpeed implementations dsfunc has one of
PIPELINE_WITHOUT_EFFECT = {
    "use_reentrant": (
        "DeepSpeed chooses between torch's reentrant and non-reentrant activation checkpointing, which compute "
        "the same gradients; dsfunc recomputes checkpointed layers its one way"
    ),
}


def _pipeline(value: Any, path: str) -> PipelineConfig:
    if isinstance(value, Mapping) and value.get("stages") == "auto":
        value = {k: v for k, v in value.items() if k != "stages"}
    return _check(value, path)


def parse_pipeline(section: Any) -> PipelineConfig:
    """A ``pipeline`` section (or an int: the stages), validated and completed as inside a whole config."""
    if isinstance(section, PipelineConfig):
        return section
    if isinstance(section, int) and not isinstance(section, bool):
        section = {"stages": section}
    return _pipeline(section, "pipeline")

