"""Whether a checkpoint fits a template state, and which of its entries the template takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsfunc.checkpoint.errors import CheckpointMismatchError
from dsfunc.checkpoint.keys import entries
from dsfunc.checkpoint.metadata import precision
from dsfunc.checkpoint.per_param import LAYOUT, param_key, uses_per_param, whole_params
from dsfunc.state import TrainState


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which parts of a checkpoint a load takes; every other part keeps the template's values.

    ``optimizer``: the optimizer's state (moments, counters) and, as in DeepSpeed, the fp16 loss scaler;
    ``schedule``: the lr schedule's position; ``module_only``: parameters and buffers only (the step
    count, dropout seed, metrics, optimizer and schedule all stay the template's); ``module_strict=False``:
    frozen parameters the checkpoint leaves out keep the template's values.
    """

    optimizer: bool = True
    schedule: bool = True
    module_only: bool = False
    module_strict: bool = True

    def parts(self) -> set[str]:
        if self.module_only:
            return {"params", "buffers"}
        kept = {"step", "rng", "params", "buffers", "metrics"}
        return kept | ({"optimizer", "scaler"} if self.optimizer else set()) | ({"schedule"} if self.schedule else set())


def check_compatible(folder: Path, meta: dict[str, Any], state: TrainState, selection: Selection) -> None:
    """Raise naming every parameter, buffer or optimizer entry that differs from the template's."""
    plan = state.program.plan
    saved = {p["name"]: tuple(p["shape"]) for u in meta["units"] for p in u["params"]}
    saved.update({f"{n} (buffer)": tuple(b["shape"]) for n, b in meta["buffers"].items()})
    mine = {name: shape for u in plan.units for name, shape, _ in whole_params(state, u)}
    mine.update({f"{n} (buffer)": tuple(t.shape) for n, t in state.buffers.items()})
    pipelined = state.program.run.pipeline is not None
    if pipelined:  # a pipeline stage holds part of the model: the rest of the checkpoint is the other stages'
        saved = {k: v for k, v in saved.items() if k in mine}
    left_out = left_out_frozen(meta, state)
    for name in left_out:
        del mine[f"{name} (buffer)"]
    lines = differences(saved, mine, "the model")
    if lines:
        raise CheckpointMismatchError(
            f"the checkpoint {folder} does not match this model:\n" + "\n".join(lines)
            + "\nBuild the template state from the model the checkpoint was saved from."
        )
    if left_out and selection.module_strict:
        more = f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""
        raise CheckpointMismatchError(
            f"the checkpoint {folder} leaves out the frozen parameters {', '.join(left_out[:5])}{more} (saved "
            "with exclude_frozen_parameters=True): pass load_module_strict=False to keep this model's values "
            "for them"
        )
    saved_units = [(u["name"], [p["name"] for p in u["params"]]) for u in meta["units"]]
    my_units = [(u.name, [name for name, _, _ in whole_params(state, u)]) for u in plan.units]
    if pipelined:
        saved_units = [u for u in saved_units if u[0] in {name for name, _ in my_units}]
    per_param = meta.get("layout", "units") == LAYOUT  # read by parameter name: any grouping into units takes it
    if saved_units != my_units and not per_param:
        raise CheckpointMismatchError(
            f"the checkpoint {folder} groups the parameters into units {[n for n, _ in saved_units]}, this "
            f"state into {[n for n, _ in my_units]}: pass the unit_modules the saving run used to "
            "dsfunc.init_state"
        )

    def describe(unit: str | None, shape: Any) -> str:
        return f"unit {unit}" if unit else f"shape {tuple(shape)}"

    units = {u.name for u in plan.units}
    saved_opt = {k[6:]: describe(None if "param" in v else v["unit"], v["shape"])
                 for k, v in (meta["tensors"] if per_param else unit_tensors(meta)).items()
                 if k.startswith("optim/") and not (pipelined and v["unit"] is not None and v["unit"] not in units)}
    mine_opt = {k[6:]: describe(unit, shape) for k, (unit, shape) in stored_keys(state, per_param).items()
                if k.startswith("optim/")}
    lines = differences(saved_opt, mine_opt, "this state's optimizer")
    if lines and selection.optimizer and not selection.module_only:
        cfg = state.program.config
        mine_type = cfg.optimizer.type if cfg.optimizer is not None else "a custom transform"
        raise CheckpointMismatchError(
            f"the optimizer state in {folder} (optimizer {meta['optimizer']!r}) does not fit this state's "
            f"optimizer ({mine_type!r}):\n" + "\n".join(lines) + "\nUse the optimizer the checkpoint was "
            "saved with, or pass load_optimizer_states=False to load everything else and start this "
            "optimizer fresh (its LR schedule restarts too)."
        )
    if uses_per_param(state) and meta.get("layout", "units") != LAYOUT:
        tp = state.program.tensor is not None
        raise CheckpointMismatchError(
            f"the checkpoint {folder} holds each unit as one flat vector (saved without tensor parallelism"
            f"{'' if tp else ' or MoE experts, by an earlier dsfunc'}), which a "
            f"{'tensor-parallel state' if tp else 'state with MoE experts'} cannot take yet: "
            f"{'load it at tensor_parallel.autotp_size 1 and save it again, or ' if tp else ''}export it "
            "(dsfunc export) and build the state from the exported weights"
        )
    absent = sorted(stored_keys(state, per_param, wanted(meta, state, selection)).keys()
                    - (meta["tensors"] if per_param else unit_tensors(meta)).keys())
    if absent:
        raise CheckpointMismatchError(
            f"the checkpoint {folder} (written by dsfunc {meta.get('dsfunc_version')}) has no "
            f"{', '.join(absent)}, which this state needs"
        )


def differences(saved: Mapping[str, Any], mine: Mapping[str, Any], what: str, limit: int = 10) -> list[str]:
    """Lines naming what only the checkpoint has, what only ``what`` has, and what differs (by key): each kind
    with its count, then one entry a line, the first ``limit`` of them."""
    def listed(title: str, names: list[str]) -> list[str]:
        more = [f"    ... and {len(names) - limit} more"] if len(names) > limit else []
        return [f"  {title} ({len(names)}):", *(f"    {n}" for n in names[:limit]), *more]

    lines = []
    if only_saved := sorted(saved.keys() - mine.keys()):
        lines += listed(f"in the checkpoint but not in {what}", only_saved)
    if only_mine := sorted(mine.keys() - saved.keys()):
        lines += listed(f"in {what} but not in the checkpoint", only_mine)
    if changed := sorted(k for k in saved.keys() & mine.keys() if saved[k] != mine[k]):
        lines += listed("different", [f"{k} (checkpoint {saved[k]}, {what} {mine[k]})" for k in changed])
    return lines


def stored_keys(state: TrainState, per_param: bool,
                keys: set[str] | None = None) -> dict[str, tuple[str | None, tuple[int, ...]]]:
    """``{key: (unit, shape)}`` of ``state``'s entries (those in ``keys``) as a checkpoint stores them: in a
    per-parameter one (:mod:`.per_param`) each unit-shaped tensor as its parameters (no unit, their whole shapes)."""
    plan = state.program.plan
    out: dict[str, tuple[str | None, tuple[int, ...]]] = {}
    for e in entries(state):
        if keys is not None and e.key not in keys:
            continue
        if per_param and e.unit is not None:
            out.update({param_key(e.key, name): (None, shape) for name, shape, _ in whole_params(state, plan.unit(e.unit))})
        else:
            out[e.key] = (e.unit, tuple(e.tensor.shape))
    return out


def unit_tensors(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The metadata's ``tensors`` under the keys a state's entries have: a per-parameter checkpoint's parts of a
    unit-shaped tensor (:mod:`.per_param`) as the one unit-shaped tensor they make up."""
    numel = {u["name"]: u["numel"] for u in meta["units"]}
    out = {}
    for key, t in meta["tensors"].items():
        if "param" in t:
            key, t = f"{key.removesuffix(t['param'])}{t['unit']}", {**t, "shape": [numel[t["unit"]]]}
            t.pop("param")
        out[key] = t
    return out


def left_out_frozen(meta: dict[str, Any], state: TrainState) -> list[str]:
    """The template's frozen parameters that the checkpoint holds neither frozen nor trained (it was saved
    excluding them)."""
    trained = {p["name"] for u in meta["units"] for p in u["params"]}
    return [name for name in state.program.plan.frozen if name not in meta["buffers"] and name not in trained]


def wanted(meta: dict[str, Any], state: TrainState, selection: Selection) -> set[str]:
    """The template's keys to read: the selected parts, the loss-scaler state only for the same precision
    and kind of scaler, metrics only those the checkpoint has, and no frozen parameter it left out."""
    same_precision = meta["precision"] == precision(state)
    load_scaler = same_precision and meta["scaler"]["dynamic"] == state.program.scaler.dynamic
    parts = selection.parts()
    left_out = {f"buffers/{name}" for name in left_out_frozen(meta, state)}
    keys = set()
    for e in entries(state):
        skip = ((e.part not in parts)
                or (e.part == "scaler" and not load_scaler)
                or (e.part == "metrics" and e.key not in meta["tensors"])
                or e.key in left_out)
        if not skip:
            keys.add(e.key)
    return keys
