"""``Config``: the whole DeepSpeed config, resolved against the data-parallel world size."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dsfunc.config.activation_checkpointing import ActivationCheckpointingConfig, _activation_checkpointing
from dsfunc.config.batch import _batch_size, _check_triple, _resolve_batch, _world_size
from dsfunc.config.checkpoint import CheckpointConfig, _checkpoint
from dsfunc.config.checks import (
    _DTYPE_NAME,
    _NON_NEGATIVE,
    _bool,
    _choice,
    _flag,
    _integer,
    _number,
    _optional,
    _print_steps,
    _without_effect_line,
)
from dsfunc.config.compile import CompileConfig, _compile
from dsfunc.config.errors import ConfigError
from dsfunc.config.expert_parallel import ExpertParallelConfig, _expert_parallel
from dsfunc.config.flops_profiler import FlopsProfilerConfig
from dsfunc.config.monitor import CometConfig, MonitorConfig, WandbConfig
from dsfunc.config.optimizer import OptimizerConfig, _optimizer
from dsfunc.config.parallel import TensorParallelConfig, _tensor_parallel, parse_tensor_parallel
from dsfunc.config.pipeline import PIPELINE_WITHOUT_EFFECT, PipelineConfig, _pipeline, parse_pipeline
from dsfunc.config.precision import (
    _BF16_FIXED,
    _FP16_FIXED,
    BF16_WITHOUT_EFFECT,
    BF16Config,
    FP16Config,
    _data_types,
)
from dsfunc.config.scheduler import SchedulerConfig, _scheduler
from dsfunc.config.schema import _key, _parse, _Schema, _section, _Spec, _specs_of
from dsfunc.config.sources import _read_source
from dsfunc.config.unsupported import _UNSUPPORTED_TOP
from dsfunc.config.zero import ZeroConfig, _zero, without_effect
from dsfunc.frozen import FrozenDict, freeze, thaw


def _allreduce_op(value: Any, path: str) -> str:
    """``"mean"`` or ``"sum"``, in any case (DeepSpeed lower-cases it). Another value's error starts with
    DeepSpeed's words, which its scripts and tests match."""
    try:
        return _choice("mean", "sum")(value.lower() if isinstance(value, str) else value, path)
    except ConfigError as e:
        raise ConfigError(f"Invalid gradient_allreduce_op: {e}") from None


@dataclass(frozen=True)
class Config:
    """A resolved, validated DeepSpeed config. Build it with ``Config.load``."""

    train_batch_size: int
    """Samples per optimizer step over all data-parallel ranks: micro batch * accumulation steps * world_size
    (resolved from the keys given, as DeepSpeed does).
    """
    train_micro_batch_size_per_gpu: int
    """Samples per rank in one forward and backward."""
    gradient_accumulation_steps: int
    """Micro-batches per rank in one optimizer step."""
    world_size: int
    """Not a key: the data-parallel size the batch triple was resolved against."""
    optimizer: OptimizerConfig | None
    """The optimizer section; None when the config has none (init_state then needs optimizer=)."""
    scheduler: SchedulerConfig | None
    """The lr schedule section; None: each group keeps its optimizer lr."""
    fp16: FP16Config
    """fp16 mixed precision and loss scaling."""
    bf16: BF16Config
    """bf16 mixed precision (the key bfloat16 is read as bf16)."""
    zero_optimization: ZeroConfig
    """The ZeRO stage and its knobs (the legacy true/false reads as stage 1/0)."""
    gradient_clipping: float = _key(1.0, _NON_NEGATIVE)
    """Clip the global L2 norm of the (unscaled) gradients to this; 0 turns clipping off. The default 1.0 is
    DeepSpeed's since 0.19.3.
    """
    steps_per_print: int | None = _key(10, _print_steps)
    """Optimizer steps between progress lines on rank 0; null (or infinity, as accelerate sets it): none.
    dsfunc's default is 10; DeepSpeed 0.19.8's is null (its engine prints no progress lines unless asked).
    """
    wall_clock_breakdown: bool = _key(False, _bool)
    """Add a time (ms) line of forward, backward and step to the progress lines, and those times as monitor
    events (the engine synchronises the device to time them).
    """
    communication_data_type: str | None = _key(None, _DTYPE_NAME)
    """The dtype gradients are reduced in ("fp32", "fp16", "bf16"). Unset means fp32 in dsfunc, where
    DeepSpeed then uses the compute dtype (fp16 or bf16).
    """
    prescale_gradients: bool = _key(False, _bool)
    """Parsed and kept, not read: DeepSpeed's true divides gradients by the world size before the reduction
    instead of after; dsfunc's collectives sum, and the 1/world of the mean is in the backward seed.
    """
    gradient_predivide_factor: float = _key(1.0, _number(gt=0.0))
    """Parsed and kept, not read: DeepSpeed divides gradients by it before the reduction and by world / it
    after; dsfunc's 1/world is in the backward seed.
    """
    gradient_allreduce_op: str = _key("mean", _allreduce_op)
    """How gradients combine over the data-parallel ranks: "mean" (the default), or "sum" (each rank's gradient
    is still the mean over its micro-batches). Any case, as DeepSpeed; "sum" is refused at ZeRO stage 3, as
    there.
    """
    dataloader_drop_last: bool = _key(False, _bool)
    """Whether the loader dsfunc.initialize(training_data=...) returns drops an incomplete last micro-batch of
    each epoch (dsfunc.batches always drops it)."""
    managed_gradient_accumulation: bool = _key(True, _bool)
    """False: the engine's script owns the accumulation boundary, as in DeepSpeed: every ``engine.step()`` applies
    the update of the backwards since the last one (each loss divided by gradient_accumulation_steps, whatever their
    count). Read by the engine only: ``dsfunc.train_step``'s batch holds its micro-batches."""
    zero_allow_untested_optimizer: bool = _key(False, _flag)
    """Parsed and kept, not read: dsfunc runs any optimizer under ZeRO, so DeepSpeed's refusal of untested
    ones has nothing to allow (1 and 0 read as true and false, as in DeepSpeed).
    """
    grad_accum_dtype: str | None = None
    """Not a key itself: data_types.grad_accum_dtype, parsed and kept, not read (dsfunc sums micro-batch
    gradients in fp32).
    """
    buffer_dtype: str | None = None
    """Not a key itself: data_types.buffer_dtype, the dtype the module's floating buffers are cast to once, when
    the state is built (None: each keeps its own, as in DeepSpeed, where fp32 rotary ``inv_freq`` stays fp32; the
    forward reads a module's buffers in the compute dtype only where that module has parameters of its own, as
    BatchNorm's statistics: dsfunc.zero.binding).
    """
    tensorboard: MonitorConfig = MonitorConfig()  # noqa: RUF009 (a frozen dataclass, safe to share)
    """TensorBoard events of the step's scalars (needs the tensorboard package)."""
    csv_monitor: MonitorConfig = MonitorConfig()  # noqa: RUF009
    """The same scalars as CSV files, one per event, as DeepSpeed writes them."""
    wandb: WandbConfig = WandbConfig()  # noqa: RUF009
    """The same scalars in a Weights & Biases run (needs the wandb package)."""
    comet: CometConfig = CometConfig()  # noqa: RUF009
    """The same scalars in a Comet experiment (needs the comet_ml package)."""
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()  # noqa: RUF009
    """DeepSpeed's FLOPs profile of one step, and the device peak the progress line's MFU divides by."""
    compile: CompileConfig = CompileConfig()  # noqa: RUF009
    """torch.compile of each unit's forward, and dsfunc's whole-step CUDA graph."""
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()  # noqa: RUF009
    """DeepSpeed's activation checkpointing keys, and dsfunc's per-unit policy."""
    pipeline: PipelineConfig = PipelineConfig()  # noqa: RUF009
    """Pipeline parallelism: stages and schedule (dsfunc.pipeline)."""
    checkpoint: CheckpointConfig = CheckpointConfig()  # noqa: RUF009
    """What a save does when the ranks give different tags (tag_validation)."""
    tensor_parallel: TensorParallelConfig = TensorParallelConfig()  # noqa: RUF009
    """AutoTP training: the mesh's tp axis and how layers are split over it (dsfunc.parallel)."""
    expert_parallel: ExpertParallelConfig = ExpertParallelConfig()  # noqa: RUF009
    """AutoEP: a Hugging Face model's MoE blocks replaced by expert-parallel ones (dsfunc.experts.autoep)."""
    sequence_parallel_size: int = _key(1, _integer(ge=1))
    """Ranks the sequence is split over (the mesh's sp axis, Ulysses); ZeRO shards over dp x sp, the batch sizes
    count dp (world / sp / ...), as DeepSpeed's.
    """
    raw: Mapping[str, Any] = FrozenDict()
    """Not a key: the user's dict as given, frozen (checkpoints record it; without_effect reads the keys given
    from it).
    """

    # Read as a dict, a config is the user's dict as given (``raw``), as DeepSpeed's ``engine.config`` is:
    # libraries read it so (``engine.config.get("zero_optimization", {})``).
    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def keys(self) -> Any:
        return self.raw.keys()

    def items(self) -> Any:
        return self.raw.items()

    def values(self) -> Any:
        return self.raw.values()

    def __post_init__(self) -> None:
        object.__setattr__(self, "raw", freeze(self.raw))
        t, m, g, w = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            self.world_size,
        )
        _check_triple(t, m, g, w)
        if self.gradient_allreduce_op == "sum" and self.zero_optimization.stage == 3:
            raise ConfigError('gradient_allreduce_op = "sum" is not supported with ZeRO stage 3 (nor in DeepSpeed); '
                              'use "mean", or ZeRO stage 0-2.')
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "fp16.enabled and bf16.enabled are both true: bfloat16 and fp16 modes cannot be "
                "simultaneously enabled. Enable only one of them."
            )
        _check_bf16_masters(self.bf16, self.zero_optimization)

    @classmethod
    def load(cls, source: Any, *, world_size: int | None = None) -> Config:
        """Read and validate a DeepSpeed config.

        Args:
            source: a dict; a path (str or PathLike) to a JSON file; a urlsafe-base64 JSON string;
                an ``argparse.Namespace`` whose ``deepspeed_config`` is a path or dict; or a ``Config``
                (returned as is, or re-resolved from its ``raw`` dict when ``world_size`` differs).
            world_size: the data-parallel size for the batch triple; None means the torch.distributed
                world size when a process group is initialised, else 1.

        Returns:
            The resolved ``Config``. Raises ``ConfigError`` naming the key path on any problem.

        Example:
            >>> config = Config.load({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=2)
            >>> config.gradient_accumulation_steps
            4
        """
        world = _world_size(world_size)
        if isinstance(source, Config):
            return source if source.world_size == world else cls._from_dict(source.raw, world)
        return cls._from_dict(_read_source(source), world)

    @classmethod
    def _from_dict(cls, raw: Mapping[str, Any], world_size: int) -> Config:
        values = _parse(raw, "", _TOP)
        data_types = values.pop("data_types") or {}
        values["grad_accum_dtype"] = data_types.get("grad_accum_dtype")
        values["buffer_dtype"] = data_types.get("buffer_dtype")
        triple = _resolve_batch(
            values.pop("train_batch_size"),
            values.pop("train_micro_batch_size_per_gpu"),
            values.pop("gradient_accumulation_steps"),
            world_size,
        )
        return cls(*triple, world_size=world_size, raw=raw, **values)

    def without_effect(self) -> list[str]:
        """Lines naming the keys this config sets that dsfunc accepts but that change nothing in it (said once
        at start-up by :func:`~dsfunc.config.announce_without_effect`): read from ``raw``, the keys as given."""
        lines = [*without_effect(self.raw.get("zero_optimization")),
                 _without_effect_line("bf16", self.raw.get("bf16", self.raw.get("bfloat16")), BF16_WITHOUT_EFFECT),
                 _without_effect_line("pipeline", self.raw.get("pipeline"), PIPELINE_WITHOUT_EFFECT)]
        return [line for line in lines if line]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward/backward run in: bfloat16, float16 or float32."""
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    def to_dict(self) -> dict[str, Any]:
        """The resolved values as plain JSON data.

        ``Config.load`` of the result at the same world size gives a Config with equal values.
        """
        out: dict[str, Any] = {
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        for name in ("optimizer", "scheduler"):
            section = getattr(self, name)
            out[name] = None if section is None else {"type": section.type, "params": thaw(section.params)}
        for name in ("fp16", "bf16", "zero_optimization", "tensorboard", "csv_monitor", "wandb", "comet",
                     "flops_profiler", "compile", "activation_checkpointing", "pipeline", "checkpoint",
                     "tensor_parallel", "expert_parallel"):
            out[name] = thaw(dataclasses.asdict(getattr(self, name)))
        for f in dataclasses.fields(self):
            if "check" in f.metadata:
                out[f.name] = getattr(self, f.name)
        out["data_types"] = {"grad_accum_dtype": self.grad_accum_dtype, "buffer_dtype": self.buffer_dtype}
        return out


_TOP = _Schema(
    specs={
        "train_batch_size": _Spec(None, _optional(_batch_size)),
        "train_micro_batch_size_per_gpu": _Spec(None, _optional(_batch_size)),
        "gradient_accumulation_steps": _Spec(None, _optional(_batch_size)),
        "optimizer": _Spec(None, _optional(_optimizer)),
        "scheduler": _Spec(None, _optional(_scheduler)),
        "fp16": _Spec(FP16Config(), _section(FP16Config, _FP16_FIXED)),
        "bf16": _Spec(BF16Config(), _section(BF16Config, _BF16_FIXED)),
        "zero_optimization": _Spec(ZeroConfig(), _zero),
        "data_types": _Spec(None, _data_types),
        "tensorboard": _Spec(MonitorConfig(), _section(MonitorConfig)),
        "csv_monitor": _Spec(MonitorConfig(), _section(MonitorConfig)),
        "wandb": _Spec(WandbConfig(), _section(WandbConfig)),
        "comet": _Spec(CometConfig(), _section(CometConfig)),
        "flops_profiler": _Spec(FlopsProfilerConfig(), _section(FlopsProfilerConfig)),
        "compile": _Spec(CompileConfig(), _compile),
        "activation_checkpointing": _Spec(ActivationCheckpointingConfig(), _activation_checkpointing),
        "pipeline": _Spec(PipelineConfig(), _pipeline),
        "checkpoint": _Spec(CheckpointConfig(), _checkpoint),
        "tensor_parallel": _Spec(TensorParallelConfig(), _tensor_parallel),
        "expert_parallel": _Spec(ExpertParallelConfig(), _expert_parallel),
    }
    | _specs_of(Config),
    fixed=_UNSUPPORTED_TOP,
    aliases={"bfloat16": "bf16"},
)


def pipeline_section(source: Any) -> PipelineConfig:
    """The ``pipeline`` section of a config source (dict, JSON path, ``Config``, ...), read before the rest:
    the stages decide the data-parallel size the batch triple is resolved against."""
    if isinstance(source, Config):
        return source.pipeline
    return parse_pipeline(_read_source(source).get("pipeline"))


def mesh_sections(source: Any) -> tuple[TensorParallelConfig, int, PipelineConfig]:
    """The ``tensor_parallel`` section, ``sequence_parallel_size`` and the ``pipeline`` section of a config source,
    read before the rest: the mesh they describe decides the data-parallel size the batch triple counts."""
    if isinstance(source, Config):
        return source.tensor_parallel, source.sequence_parallel_size, source.pipeline
    raw = _read_source(source)
    sp = _integer(ge=1)(raw.get("sequence_parallel_size", 1), "sequence_parallel_size")
    return parse_tensor_parallel(raw.get("tensor_parallel")), sp, parse_pipeline(raw.get("pipeline"))


def _check_bf16_masters(bf16: BF16Config, zero: Any) -> None:
    """DeepSpeed's rules for bf16 master weights and optimizer states; ``bf16.rounding`` only rounds bf16 masters."""
    if not (bf16.bf16_master_weights_and_grads or bf16.bf16_optimizer_states):
        if bf16.rounding != "nearest":
            raise ConfigError(f"bf16.rounding = {bf16.rounding!r} rounds bf16 master weights, which this config does "
                              "not keep: set bf16.bf16_master_weights_and_grads (and bf16_optimizer_states) to true, "
                              "or remove bf16.rounding")
        return
    if bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        raise ConfigError("bf16.bf16_optimizer_states requires bf16.bf16_master_weights_and_grads (as in DeepSpeed): "
                          "set both to true")
    if not bf16.enabled:
        raise ConfigError("bf16.bf16_master_weights_and_grads needs bf16.enabled = true")
    if zero.stage not in (1, 2, 3):
        raise ConfigError(f"bf16.bf16_master_weights_and_grads is only supported with ZeRO stage 1, 2 or 3 (as in "
                          f"DeepSpeed); zero_optimization.stage is {zero.stage}")
    if not bf16.bf16_optimizer_states and zero.offload_optimizer is None:
        raise ConfigError("bf16.bf16_master_weights_and_grads without bf16.bf16_optimizer_states keeps the moments in "
                          "fp32, which needs zero_optimization.offload_optimizer (as in DeepSpeed, where the CPU Adam "
                          "holds them): add \"offload_optimizer\": {\"device\": \"cpu\"}, or set "
                          "bf16.bf16_optimizer_states to true as well")
