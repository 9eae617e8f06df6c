"""Top-level DeepSpeed sections dsfunc does not implement, accepted only while off or at their default.

Every key is checked: a section that is off is still checked against DeepSpeed's table of its keys
(:mod:`dsfunc.config.deepspeed_keys`), and keys DeepSpeed has removed are errors, as in DeepSpeed 0.19.8.
"""

from __future__ import annotations

from dsfunc.config import deepspeed_keys as ds
from dsfunc.config.checks import (
    _DTYPE_NAME,
    _accepted,
    _bool,
    _empty,
    _fields,
    _integer,
    _off,
    _only,
    _removed,
)
from dsfunc.config.schema import Rule

_UNSUPPORTED_TOP: dict[str, Rule] = {
    "autotuning": _off("autotuning", ds.AUTOTUNING),
    "data_efficiency": _off("data efficiency (curriculum learning, random-LTD)", ds.DATA_EFFICIENCY),
    "comms_logger": _off("the communication logger", ds.COMMS_LOGGER),
    "aio": _accepted(_fields(ds.AIO)),  # tunes NVMe I/O, which only offload to NVMe (refused) uses
    "timers": _only(
        {"throughput": {"enabled": True, "synchronized": True}}, feature="configuring the timers"
    ),
    "memory_breakdown": _only(False, feature="memory breakdown logging"),
    "dump_state": _only(False, feature="dumping the engine state"),
    "log_level": _only(
        None,
        feature="log_level",
        fix='dsfunc logs to the "dsfunc" logger; set its level with the logging module.',
    ),
    "vocabulary_size": _accepted(_integer(ge=1)),  # DeepSpeed only warns when it is not a multiple of 8
    "zero_force_ds_cpu_optimizer": _accepted(_bool),  # dsfunc's offload updates on the host with any optimizer
    "disable_allgather": _only(False, feature="disable_allgather"),
    "torch_autocast": _off("torch.autocast mixed precision", ds.TORCH_AUTOCAST, 'Use "fp16" or "bf16".'),
    "hybrid_engine": _off("the hybrid (RLHF) engine", ds.HYBRID_ENGINE),
    "weight_quantization": _empty("weight quantization"),
    "seq_parallel_communication_data_type": _accepted(_DTYPE_NAME),  # only used by sequence parallelism
    "disable_python_gc": _only(False, feature="disabling Python's garbage collector"),
    "use_data_before_expert_parallelism": _only(False, feature="expert parallelism"),
    "datastates_ckpt": _only(None, False, feature="DataStates checkpointing"),
} | {key: _removed(message, ds.REMOVED_SEE) for key, message in ds.REMOVED_TOP.items()}
