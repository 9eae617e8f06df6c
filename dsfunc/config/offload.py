"""``zero_optimization.offload_optimizer`` / ``offload_param``: ZeRO-Offload to host memory.

``device: "cpu"`` turns it on, ``"none"`` (DeepSpeed's default, or the section absent) leaves it off, and
``"nvme"`` (ZeRO-Infinity) is not built. DeepSpeed's other keys of the sections tune NVMe swapping, tiles
or Superchip offload, none of which dsfunc has: with offload on they must keep DeepSpeed's default
(``tests/config/test_zero.py`` checks these defaults against DeepSpeed's own classes). With offload off
any valid value is accepted, as DeepSpeed ignores them then. ``offload_optimizer`` has two keys of dsfunc's
own, ``grad_accumulation_on_device``, ``micro_batches_per_backward`` and ``speculative_update`` (which DeepSpeed's
``super_offload`` turns on; :class:`OffloadConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsfunc.config import deepspeed_keys as ds
from dsfunc.config.checks import _SIZE, _STEPS, _fields
from dsfunc.config.errors import ConfigError, _bad, _show
from dsfunc.config.schema import Check, _as_is

# DeepSpeed 0.19.8's defaults (runtime/zero/offload_config.py) of the keys that cannot apply to CPU offload
OPTIMIZER_DEFAULTS: Mapping[str, Any] = {
    "nvme_path": None, "buffer_count": 4, "pipeline_read": False, "pipeline_write": False, "fast_init": False,
    "ratio": 1.0, "cpuadam_cores_perc": 0.8,
}
PARAM_DEFAULTS: Mapping[str, Any] = {
    "nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000,
}


@dataclass(frozen=True)
class OffloadConfig:
    """An offload section that is on: where to (always ``"cpu"``) and whether host memory is pinned."""

    device: str = "cpu"
    """Always "cpu": an offload section that is off parses to None instead, and "nvme" is refused."""
    pin_memory: bool = True
    """Page-lock the host buffers (asynchronous copies), only where CUDA is available and kept pageable if
    page-locking fails; true is DeepSpeed's default since 0.19.5.
    """
    grad_accumulation_on_device: int = 0
    """dsfunc's own key of ``offload_optimizer`` (stages 2-3): elements of this rank's gradient shards whose
    sums stay on the compute device between micro-batches (4 bytes each in fp32) and after the last until the
    host update reads them, whole units in the order backward reaches them. The other units' sums go to host
    memory and come back for each micro-batch, 8 bytes a parameter over PCIe; these go to the host once a step,
    beside the update, and need no host gradient buffer of their own. 0 (default): none.
    """
    micro_batches_per_backward: int = 1
    """dsfunc's own key of ``offload_optimizer`` (stages 2-3, ``train_step``): how many micro-batches run their
    forwards before one backward goes through them all, unit by unit from the last to the first
    (:mod:`dsfunc.zero.backward_by_units`). Each unit's gradient sum then stays on the device across those
    micro-batches and crosses PCIe once for them, not once each. It costs the memory of that many
    micro-batches' saved activations at once (with activation checkpointing, each unit's input), and needs the
    units to form a chain: what a unit takes from the units before it passes through no other unit's input.
    1 (default): each micro-batch's backward follows its forward. No effect under the DeepSpeed engine, whose
    script runs each backward itself.
    """
    speculative_update: bool | int = False
    """dsfunc's own key of ``offload_optimizer`` (``train_step``), which DeepSpeed's ``super_offload: true``
    also turns on: each unit's host update starts as its gradient lands during the last backward, assuming the
    step neither clips nor overflows, and is undone and redone when it does, so the result is bit for bit the
    update's without it (:mod:`dsfunc.zero.offload.speculation`). It costs host memory for spare buffers the
    size of the masters and optimizer state (12 bytes a parameter with Adam; 6 with bf16 masters and moments,
    whose chain it runs ahead the same way). ``true``: every unit; a number: elements of this rank's shards
    whose units run ahead, whole units in the order their gradients land (the spares of a 6B model's fp32
    states would not fit beside it in 128 GiB of host memory; the rest wait for the step as without it).
    Of SuperOffload only this is built; its ``cpuadam_cores_perc`` must keep DeepSpeed's default. No effect
    under the DeepSpeed engine.
    """


def _speculation(value: Any, path: str) -> bool | int:
    """``speculative_update``: true or false, or elements (5e8-style numbers are fine)."""
    return value if isinstance(value, bool) else _SIZE(value, path)


def _offload_section(what: str, keys: Mapping[str, Any], defaults: Mapping[str, Any],
                     own: Mapping[str, Check] | None = None, turns_on: Mapping[str, str] | None = None):
    """The check of one offload section: ``None`` when off, else an :class:`OffloadConfig`. ``own``: the
    section's keys that are dsfunc's, not DeepSpeed's; ``turns_on``: DeepSpeed's keys that, true, set one of
    them true."""
    check = _fields({"device": _as_is, **keys, **(own or {})})

    def parse(value: Any, path: str) -> OffloadConfig | None:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise _bad(path, value, 'a JSON object such as {"device": "cpu"}')
        values = check(value, path)
        device = value.get("device", "none")
        if device in (None, "none"):
            return None
        if device == "nvme":
            raise ConfigError(
                f'{path}.device = "nvme": offloading {what} to NVMe (ZeRO-Infinity) is not built in dsfunc; '
                f'use "device": "cpu" (host memory) or "none".'
            )
        if device != "cpu":
            raise _bad(f"{path}.device", device, '"none", "cpu" or "nvme"')
        for key, default in defaults.items():
            if key in value and value[key] != default:
                raise ConfigError(
                    f"{path}.{key} = {_show(value[key])}: dsfunc's offload to the CPU has no use for it (it tunes "
                    f"NVMe swapping, tiled or partial offload, which dsfunc lacks). Remove the key or set it to "
                    f"{_show(default)} (DeepSpeed's default)."
                )
        extra = {key: values[key] for key in own or {} if values[key] is not None}
        extra.update({mine: True for theirs, mine in (turns_on or {}).items() if values[theirs]})
        return OffloadConfig(pin_memory=True if values["pin_memory"] is None else values["pin_memory"], **extra)

    return parse


offload_optimizer = _offload_section("optimizer state", ds.OFFLOAD_OPTIMIZER, OPTIMIZER_DEFAULTS,
                                    {"grad_accumulation_on_device": _SIZE, "micro_batches_per_backward": _STEPS,
                                     "speculative_update": _speculation},
                                    turns_on={"super_offload": "speculative_update"})
offload_param = _offload_section("parameters", ds.OFFLOAD_PARAM, PARAM_DEFAULTS)


def offload_without_effect(section: Mapping[str, Any]) -> str | None:
    """The start-up line for offload sections a raw ``zero_optimization`` section turns on where they do nothing:
    below the stage that uses them (DeepSpeed 0.19.8 accepts and ignores them there: the optimizer offloads only
    under ZeRO, parameters only at stage 3), and ``offload_param`` without ``offload_optimizer`` (see
    :func:`params_offloadable`); None when there are none."""
    stage = section.get("stage", 0)
    if not isinstance(stage, int):
        return None
    on = [key for key in ("offload_optimizer", "offload_param")
          if isinstance(section.get(key), Mapping) and section[key].get("device") not in (None, "none")]
    below = [key for key in on if stage < (3 if key == "offload_param" else 1)]
    if below:
        verb = "has" if len(below) == 1 else "have"
        return (f"zero_optimization: {', '.join(below)} {verb} no effect in dsfunc at stage {stage} (nor in "
                "DeepSpeed: the optimizer offloads only under ZeRO, stages 1-3, and the parameters only at stage 3).")
    if on == ["offload_param"]:
        return ("zero_optimization: offload_param has no effect in dsfunc without offload_optimizer: the 16-bit "
                "parameters are made from the fp32 master weights as they are gathered, and those stay on the device, "
                "so no 16-bit shard is kept there to move (DeepSpeed keeps one and moves it to the host).")
    return None


def params_offloadable(optimizer: OffloadConfig | None, param: OffloadConfig | None) -> OffloadConfig | None:
    """``param`` where it has an effect: dsfunc offloads the parameters with the optimizer only (the compute copies
    are made from the masters, see the README); alone it is accepted, as DeepSpeed does, and dropped."""
    return param if optimizer else None
