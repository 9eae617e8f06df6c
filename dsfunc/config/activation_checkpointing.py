"""The ``activation_checkpointing`` section: DeepSpeed's keys, and dsfunc's per-unit policy.

DeepSpeed's keys configure ``deepspeed.checkpointing.checkpoint`` (which model code calls itself):
``cpu_checkpointing`` keeps the saved activations in pinned host memory, ``synchronize_checkpoint_boundary``
synchronises the device around each checkpointed call, ``profile`` logs their times. Partitioning
activations (and its contiguous buffers) splits them over model-parallel ranks, which dsfunc does not
have: asking for it is an error. dsfunc's ``policy`` checkpoints units with no change to the model:
``"units"`` (every ``every``-th unit recomputes its forward in backward), ``"selective"`` (the same, but
matmul and attention outputs are saved and only the cheap rest is recomputed), ``"none"`` (the default).
With ``cpu_checkpointing``, dsfunc's ``device_checkpoints`` keeps the last units' inputs on the device, where host
memory is what runs out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import _bool, _choice, _integer, _only, _optional
from dsfunc.config.errors import ConfigError
from dsfunc.config.schema import _key, _section

POLICIES = ("none", "units", "selective")
_NO_MODEL_PARALLELISM = "partitioned activations (they split over model-parallel ranks; dsfunc has none)"


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: which units recompute their forward in backward, and how."""

    policy: str = _key("none", _choice(*POLICIES))
    """Which unit forwards recompute in backward: "none", "units" (the whole forward) or "selective" (matmul
    and attention outputs kept, the rest recomputed). A dsfunc key: DeepSpeed only checkpoints what model code
    wraps in deepspeed.checkpointing.checkpoint.
    """
    every: int = _key(1, _integer(ge=1))
    """With a policy on, every every-th unit module is checkpointed (indices 0, every, 2*every, ... in model
    order). A dsfunc key.
    """
    cpu_checkpointing: bool = _key(False, _bool)
    """Keep what checkpointed forwards save in host memory, as DeepSpeed's key does. On a GPU the inputs copy out
    and are prefetched back asynchronously, in pinned buffers of their exact size (dsfunc.activation_offload);
    without CUDA, torch.autograd.graph.save_on_cpu keeps them.
    """
    device_checkpoints: int = _key(0, _integer(ge=0))
    """With cpu_checkpointing, the last device_checkpoints checkpointed units keep their inputs on the device
    (backward reaches them first, so they never wait for a copy back): the units whose checkpoints fit the GPU's
    spare memory when the host's is the limit. deepspeed.checkpointing.checkpoint calls offload all. A dsfunc key.
    """
    synchronize_checkpoint_boundary: bool = _key(False, _bool)
    """Synchronise the CUDA device before and after each checkpointed forward (nothing without CUDA), as in
    DeepSpeed.
    """
    profile: bool = _key(False, _bool)
    """Log each checkpointed forward's time in ms on the "dsfunc" logger at INFO (synchronising the device
    around it, as synchronize_checkpoint_boundary).
    """
    number_checkpoints: int | None = _key(None, _optional(_integer(ge=1)))
    """Parsed and kept, not read: in DeepSpeed it sizes the contiguous buffer of partitioned activations,
    which dsfunc refuses.
    """

    def __post_init__(self) -> None:
        if self.device_checkpoints and not self.cpu_checkpointing:
            raise ConfigError(
                f"activation_checkpointing.device_checkpoints = {self.device_checkpoints} keeps some units' "
                "checkpoints on the device instead of the host, but cpu_checkpointing is false (every checkpoint "
                "is on the device already): set cpu_checkpointing to true, or remove device_checkpoints."
            )

    def host_work(self) -> list[str]:
        """The options set that run host work around each checkpointed forward (none without checkpointing)."""
        options = ("cpu_checkpointing", "synchronize_checkpoint_boundary", "profile")
        return [k for k in options if getattr(self, k)] if self.policy != "none" else []

    def checkpoints(self, index: int) -> bool:
        """Whether the ``index``-th unit module (0-based, in model order) is checkpointed."""
        return self.policy != "none" and index % self.every == 0


_FIXED = {
    "partition_activations": _only(False, feature=_NO_MODEL_PARALLELISM),
    "contiguous_memory_optimization": _only(False, feature=_NO_MODEL_PARALLELISM),
}
_activation_checkpointing = _section(ActivationCheckpointingConfig, _FIXED)


def parse_activation_checkpointing(section: Any) -> ActivationCheckpointingConfig:
    """An ``activation_checkpointing`` section, validated and completed as inside a whole config."""
    return _activation_checkpointing(section, "activation_checkpointing")
