"""``deepspeed.checkpointing``: DeepSpeed's activation checkpointing API, on :func:`dsfunc.remat.checkpoint`.

Model code that calls ``deepspeed.checkpointing.checkpoint(fn, *args)`` (the Megatron-style API) gets
dsfunc's checkpointing of that call, configured by :func:`configure` or a config's
``activation_checkpointing`` section (``cpu_checkpointing``, ``synchronize_checkpoint_boundary``,
``profile``): with ``cpu_checkpointing`` every call's inputs go to host memory (``device_checkpoints`` is for
dsfunc's unit policy, which knows which call is last). Model parallelism does not exist in dsfunc, so the RNG
tracker has one region and the model-parallel seed is the seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dsfunc.activation_offload import ActivationOffloader
from dsfunc.config import ActivationCheckpointingConfig, Config, parse_activation_checkpointing
from dsfunc.errors import InputError
from dsfunc.remat import checkpoint as _checkpoint
from dsfunc.remat import offloader_for

_OPTIONS: ActivationCheckpointingConfig | None = None
_OFFLOADER: ActivationOffloader | None = None


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Configure :func:`checkpoint` as DeepSpeed does: from a config's ``activation_checkpointing``
    section, then the explicit arguments on top."""
    global _OPTIONS, _OFFLOADER
    if mpu_ is not None:
        raise InputError("deepspeed.checkpointing.configure(mpu_=...): dsfunc has no model parallelism; pass None")
    section: dict[str, Any] = {}
    if deepspeed_config is not None:
        raw = Config.load(deepspeed_config).raw
        section.update(raw.get("activation_checkpointing") or {})
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization":
             contiguous_checkpointing, "number_checkpoints": num_checkpoints, "cpu_checkpointing":
             checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    section.update({k: v for k, v in given.items() if v is not None})
    _OPTIONS = parse_activation_checkpointing({"policy": "units", **section})
    _OFFLOADER = offloader_for(_OPTIONS)


def is_configured() -> bool:
    """Whether :func:`configure` was called (since the last :func:`reset`)."""
    return _OPTIONS is not None


def reset() -> None:
    """Forget the configuration."""
    global _OPTIONS, _OFFLOADER
    _OPTIONS = _OFFLOADER = None


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` whose activations are recomputed in backward instead of kept."""
    return _checkpoint(function, *args, options=_OPTIONS, offloader=_OFFLOADER)


class _RNGTracker:
    """Megatron's CUDA RNG tracker with one region: ``fork()`` draws from the default generator."""

    def reset(self) -> None:
        """Nothing to reset: there is one region."""

    def add(self, name: str, seed: int) -> None:
        """Seeds the one region (there are no model-parallel regions to keep apart)."""
        torch.manual_seed(seed)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        yield


_TRACKER = _RNGTracker()


def get_cuda_rng_tracker() -> _RNGTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the generators (one model-parallel rank: its seed is ``seed``)."""
    torch.manual_seed(seed)
