"""``deepspeed.runtime.config.DeepSpeedConfig`` and ``DeepSpeedConfigError``, read by dsfunc's one parser.

Scripts and libraries build ``DeepSpeedConfig(path_or_dict, mpu)`` to read a config as DeepSpeed resolves it
(the batch triple against the data-parallel world size, the ZeRO stage, the optimizer's name). Here
:meth:`dsfunc.config.Config.load` reads it, so a bad key or value is the same
:class:`~dsfunc.config.ConfigError` (which is ``DeepSpeedConfigError``) as everywhere in dsfunc, and the
attributes carry DeepSpeed's names; the accessors the engine shares with it answer from the same tables
(:mod:`dsfunc.deepspeed.engine_config`).
"""

from __future__ import annotations

import os
from typing import Any

from dsfunc.config import Config, ConfigError
from dsfunc.config.batch import _check_triple, _resolve_batch
from dsfunc.config.dtypes import DTYPES
from dsfunc.deepspeed.engine_config import _FROM_CONFIG, _OFF
from dsfunc.deepspeed.namespace import other_name
from dsfunc.deepspeed.precision_config import get_bfloat16_config, get_float16_config  # noqa: F401 - DeepSpeed's names here too
from dsfunc.deepspeed.zero_config import DeepSpeedZeroConfig
from dsfunc.frozen import thaw

DeepSpeedConfigError = ConfigError

# DeepSpeed's names of its optimizer types and params, which scripts import from here
ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER = "adagrad", "adam", "adamw", "lamb"
TORCH_ADAM_PARAM, ADAM_W_MODE, ADAM_W_MODE_DEFAULT = "torch_adam", "adam_w_mode", True


# DeepSpeedConfig's attributes that the engine has as accessors of the same name and value
_SHARED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
           "steps_per_print", "wall_clock_breakdown", "dataloader_drop_last", "gradient_predivide_factor",
           "zero_allow_untested_optimizer", "zero_optimization_stage", "optimizer_params", "scheduler_name",
           "scheduler_params", "aio_config", "managed_gradient_accumulation")
_SHARED_OFF = ("dump_state", "memory_breakdown", "load_universal_checkpoint",
               "use_node_local_storage", "optimizer_legacy_fusion", "zero_force_ds_cpu_optimizer", "log_level",
               "torch_autocast_enabled", "torch_autocast_dtype", "data_efficiency_enabled")


class DeepSpeedConfig:
    """A DeepSpeed config (dict, JSON/HJSON path or base64 JSON) resolved against the data-parallel world
    size: ``mpu.get_data_parallel_world_size()`` when an ``mpu`` is given, else the process group's size (1
    without one). ``config`` is dsfunc's :class:`~dsfunc.config.Config` of it."""

    def __init__(self, config: str | os.PathLike | dict, mpu: Any = None, mesh_device: Any = None) -> None:
        if mesh_device is not None:
            raise ConfigError("DeepSpeedConfig(mesh_device=...): dsfunc resolves the batch against the data-parallel "
                              "size of the process group or of mpu; pass mpu, or neither.")
        world = mpu.get_data_parallel_world_size() if mpu is not None else None
        self.config = Config.load(config, world_size=world)
        cfg = self.config
        self._param_dict = thaw(cfg.raw)
        self.world_size = cfg.world_size
        for name in _SHARED:
            setattr(self, name, _FROM_CONFIG[name](cfg))
        for name in _SHARED_OFF:
            setattr(self, name, _OFF[name])
        zero = cfg.raw.get("zero_optimization")  # the legacy true/false is stage 1/0
        self.zero_config = DeepSpeedZeroConfig(**({"stage": int(zero)} if isinstance(zero, bool) else thaw(zero or {})))
        self.zero_enabled = cfg.zero_optimization.stage > 0
        self.float16_config = cfg.fp16
        self.bfloat16_config = cfg.bf16
        self.communication_data_type = DTYPES.get(cfg.communication_data_type)
        self.prescale_gradients = cfg.prescale_gradients
        self.gradient_allreduce_op = cfg.gradient_allreduce_op
        self.disable_allgather = False
        self.optimizer_name = cfg.raw["optimizer"]["type"].lower() if cfg.optimizer is not None else None
        self.grad_accum_dtype = cfg.grad_accum_dtype
        self.param_dtype, self.buffer_dtype = None, cfg.buffer_dtype
        self.checkpoint_tag_validation_enabled = cfg.checkpoint.tag_validation != "IGNORE"
        self.checkpoint_tag_validation_fail = cfg.checkpoint.tag_validation == "FAIL"
        self.pipeline = thaw(cfg.raw.get("pipeline") or {})

    def _configure_train_batch_size(self) -> None:
        """Resolve the batch triple again from the three attributes (None where unset), as DeepSpeed's method
        of this name does for scripts that change them; an inconsistent triple is an ``AssertionError``, as
        DeepSpeed asserts, with dsfunc's message."""
        try:
            triple = _resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                    self.gradient_accumulation_steps, self.world_size)
            _check_triple(*triple, self.world_size)
        except ConfigError as e:
            raise AssertionError(str(e)) from None
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = triple

    def __repr__(self) -> str:
        return f"DeepSpeedConfig({self.config!r})"


def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of ``deepspeed.runtime.config`` import, and refuse when used."""
    return other_name("runtime.config", name)
