"""What a DeepSpeed checkpoint says besides its tensors: precision, counters, scheduler, loss scaler, client state.

:func:`open_checkpoint` reads the rank-0 model states and the first optimizer shard (their pickles; the
tensors stay in the files) and the index of every tensor (:mod:`.shards`), so a load can check the
checkpoint against the template before any tensor is read.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from dsfunc.checkpoint.deepspeed.autotp import join_tp
from dsfunc.checkpoint.deepspeed.folder import DeepSpeedFiles, find_files, model_parallel_ranks
from dsfunc.checkpoint.deepspeed.shards import MOMENTS, ShardIndex, build_index
from dsfunc.checkpoint.deepspeed.unpickle import DeepSpeedObject, load_file
from dsfunc.checkpoint.errors import CheckpointCorruptError
from dsfunc.checkpoint.pickle_bounds import check_tensor
from dsfunc.config.dtypes import SIXTEEN_BIT, dtype_name

# what DeepSpeed's engine itself writes into the model-states file (engine.py _common_checkpoint_state and
# the MoE/universal-checkpoint extras); every other key is the client state the user passed
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info", "num_experts",
    "ds_autoep_layers", "autoep_layers", "folding",
})


@dataclasses.dataclass(frozen=True)
class Scaler:
    """DeepSpeed's loss scaler as saved: ``DynamicLossScaler`` (ZeRO) or the stage-0 fp16 optimizer's fields
    (which keep no hysteresis: ``cur_hysteresis`` is None)."""

    dynamic: bool
    scale: float
    cur_iter: int | None = None
    last_overflow_iter: int | None = None
    cur_hysteresis: int | None = None


@dataclasses.dataclass(frozen=True)
class DeepSpeedCheckpoint:
    """An opened DeepSpeed checkpoint: everything but the tensors, which :attr:`index` reads on demand."""

    files: DeepSpeedFiles
    index: ShardIndex
    precision: str  # "fp32", "fp16" or "bf16": the dtype the module was trained in
    global_steps: int
    skipped_steps: int
    optimizer: str  # the config's optimizer type, or what its state looks like
    moments: bool | None  # the optimizer state holds Adam's exp_avg and exp_avg_sq (None: no state yet, as
    #                       before the first applied step, which Adam's zero moments continue)
    adam_step: int  # Adam's step count (applied steps), 0 without optimizer state
    schedule: Mapping[str, Any] | None  # the lr scheduler's state_dict
    scaler: Scaler | None
    client: dict[str, Any]

    @property
    def folder(self) -> Path:
        return self.files.folder


def open_checkpoint(folder: Path, *, trust_pickle: bool = False,
                    frozen_hint: Iterable[str] | None = None) -> DeepSpeedCheckpoint:
    """Open the DeepSpeed checkpoint in ``folder`` (a tag folder); see :func:`.shards.build_index` for
    ``frozen_hint``."""
    files = find_files(folder)
    main = _model_states(files, trust_pickle)
    index, first = build_index(files, main, frozen_hint=frozen_hint, trust_pickle=trust_pickle)
    tp = model_parallel_ranks(folder)
    if tp > 1:  # AutoTP: each tp rank's files index its part of the model
        parts = [build_index(f, _model_states(f, trust_pickle), frozen_hint=frozen_hint, trust_pickle=trust_pickle)[0]
                 for f in (find_files(folder, mp) for mp in range(1, tp))]
        index = join_tp(folder, [index, *parts], main)
    states = _optimizer_states(main, first)
    keys = {k for s in states for k in s}
    config = main.get("ds_config")
    opt_type = config.get("optimizer", {}).get("type") if isinstance(config, Mapping) else None
    steps = [int(s["step"]) for s in states if "step" in s]
    return DeepSpeedCheckpoint(
        files=files, index=index, precision=_precision(main["module"], index),
        global_steps=int(main.get("global_steps", 0)), skipped_steps=int(main.get("skipped_steps", 0)),
        optimizer=opt_type or (f"an optimizer with state {sorted(keys)}" if keys else "no optimizer state"),
        moments=all(m in keys for m in MOMENTS) if keys else None, adam_step=max(steps, default=0),
        schedule=main.get("lr_scheduler"), scaler=_scaler(main, first),
        client=_detached({k: v for k, v in main.items() if k not in DEEPSPEED_KEYS}, files.main),
    )


def _model_states(files: DeepSpeedFiles, trust_pickle: bool) -> Mapping[str, Any]:
    main = load_file(files.main, trust_pickle=trust_pickle)
    if not isinstance(main, Mapping) or "module" not in main:
        raise CheckpointCorruptError(f"{files.main} is not a DeepSpeed model-states file (it has no 'module')")
    return main


def _optimizer_states(main: Mapping[str, Any], first: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The per-tensor optimizer states of the stage-0 optimizer, or of rank 0's ZeRO shard."""
    if first is not None:
        base = first.get("base_optimizer_state", first.get("optimizer_state_dict"))
    else:
        opt = main.get("optimizer") or {}
        base = opt.get("optimizer_state_dict", opt)
    if isinstance(base, list):
        return [s for s in base if s]
    return list((base or {}).get("state", {}).values())


def _precision(module: Mapping[str, torch.Tensor], index: ShardIndex) -> str:
    dtypes = {module[n].dtype for n in index.trainable if n in module}
    return next((dtype_name(d) for d in dtypes if d in SIXTEEN_BIT), "fp32")


def _scaler(main: Mapping[str, Any], first: Mapping[str, Any] | None) -> Scaler | None:
    if first is not None:
        saved = first.get("loss_scaler")
        if not isinstance(saved, DeepSpeedObject):
            return None
        fields = vars(saved)
        return Scaler(dynamic=bool(fields.get("dynamic")), scale=float(fields["cur_scale"]),
                      cur_iter=fields.get("cur_iter"), last_overflow_iter=fields.get("last_overflow_iter"),
                      cur_hysteresis=fields.get("cur_hysteresis"))
    opt = main.get("optimizer")
    if not isinstance(opt, Mapping) or "cur_scale" not in opt:
        return None
    return Scaler(dynamic=bool(opt.get("dynamic_loss_scale")), scale=float(opt["cur_scale"]),
                  cur_iter=opt.get("cur_iter"), last_overflow_iter=opt.get("last_overflow_iter"))


def _detached(root: Any, path: Path) -> Any:
    """``root`` (read from ``path``) with its tensors copied out of the memory-mapped file: dicts, lists and
    tuples walked without recursion, each object once (an id memo: a part shared in the file stays shared,
    and a structure shared to a great depth costs its objects, not its paths)."""
    copies: dict[int, Any] = {}
    todo: list[tuple[Any, bool]] = [(root, False)]
    while todo:
        obj, children_done = todo.pop()
        if id(obj) in copies and not children_done:
            continue
        if isinstance(obj, torch.Tensor):  # the method from the class: a tensor's own state cannot shadow it
            copies[id(obj)] = torch.Tensor.clone(check_tensor(obj, path))
        elif not isinstance(obj, dict) and type(obj) not in (list, tuple):
            continue
        elif not children_done:
            if type(obj) is not tuple:  # made now, filled below: a reference back to it finds it
                copies[id(obj)] = copy.copy(obj)
            todo.append((obj, True))
            todo.extend((v, False) for v in (obj.values() if isinstance(obj, dict) else obj))
        elif isinstance(obj, dict):
            out = copies[id(obj)]
            for k, v in obj.items():
                out[k] = copies.get(id(v), v)
        elif type(obj) is list:
            copies[id(obj)][:] = [copies.get(id(v), v) for v in obj]
        else:
            copies[id(obj)] = tuple(copies.get(id(v), v) for v in obj)
    return copies.get(id(root), root)
