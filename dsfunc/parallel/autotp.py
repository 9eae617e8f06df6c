"""Which modules tensor parallelism splits, and how: the tp plan, from an explicit plan, DeepSpeed's AutoTP
surface (``partition_config`` layer specs, ``preset_model``), the Hugging Face model's own plan, or AutoTP's
match of the usual projection names.

A plan maps module paths to torch ``ParallelStyle`` s (``ColwiseParallel``: the output features split;
``RowwiseParallel``: the input features split, the output all-reduced). The sources, in DeepSpeed's order
(``runtime/tensor_parallel/config.py``): an explicit plan; ``preset_model`` and ``partition_config`` (the
layer specs' regexes match a parameter's name, ``...q_proj.weight``; the first spec that matches wins); the HF
model's ``base_model_tp_plan`` (relative to its base model) merged with its class's ``_tp_plan``; else the
projection names AutoTP knows. A model none of these matches is an error naming its linear modules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from dsfunc.config import TensorParallelConfig
from dsfunc.errors import InputError, NotSupportedError
from dsfunc.parallel.vocab import bind_loss, head_style

# DeepSpeed's AutoTPPresets.llama / .qwen2 (separate q, k, v projections)
_LLAMA = (
    ((r".*\.self_attn\.o_proj\.weight$",), "row"),
    ((r".*\.self_attn\.[qkv]_proj\.weight$",), "column"),
    ((r".*\.mlp\.down_proj\.weight$",), "row"),
    ((r".*\.mlp\.(up|gate)_proj\.weight$",), "column"),
)
PRESETS = {"llama": _LLAMA, "qwen2": _LLAMA}
# the projection names AutoTP splits when nothing else describes the model (its LinearAllreduce / LinearLayer)
AUTOTP_MATCH = (
    ((r".*\.(o_proj|out_proj|down_proj|dense_4h_to_h|fc2|c_proj|wo|w2)\.weight$",), "row"),
    ((r".*\.([qkv]_proj|query|key|value|up_proj|gate_proj|dense_h_to_4h|fc1|wq|wk|wv|w1|w3)\.weight$",), "column"),
)
# Hugging Face's tp_plan styles dsfunc applies, as torch ParallelStyles
_HF_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocab rows split, output summed
    "vocab_parallel": head_style,  # dsfunc's: an LM head whose logits stay split (dsfunc.parallel.vocab)
    # a per-head norm (Qwen3's q_norm, k_norm): its weight replicated, its input a tp rank's heads (dim -2), so the
    # weight's gradient is each rank's heads' part, all-reduced over tp by torch's SequenceParallel over that dim
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
}
_SPEC_STYLES = {"column": _HF_STYLES["colwise"], "row": _HF_STYLES["rowwise"]}

Plan = Mapping[str, "str | ParallelStyle"]


def resolve_plan(model: nn.Module, section: TensorParallelConfig, given: Plan | None) -> dict[str, ParallelStyle]:
    """The tp plan for ``model``: module path -> torch ParallelStyle (see the module's docstring for the order)."""
    if given is not None:
        plan, source = _from_patterns(model, given, "the tp_plan given"), "the tp_plan given"
    elif section.preset_model is not None or section.partition_config is not None:
        plan, source = _from_specs(model, _config_specs(section)), "tensor_parallel's preset_model/partition_config"
    elif (hf := _hf_plan(model)) is not None:
        plan, source = _from_patterns(model, hf, "the model's tp_plan"), "the model's tp_plan"
    else:
        plan, source = _from_specs(model, AUTOTP_MATCH), "AutoTP's match of projection names"
    if not plan:
        linears = [path for path, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise InputError(
            f"tensor parallelism found nothing to split in {type(model).__name__} ({source}): no module matched. "
            f"Its linear modules are {linears[:12]}{' ...' if len(linears) > 12 else ''}; give "
            'tensor_parallel.partition_config {"layer_specs": [{"patterns": [regex], "partition_type": "column" | '
            '"row"}]} or init_state(tp_plan={module path pattern: "colwise" | "rowwise"})')
    return plan


def _config_specs(section: TensorParallelConfig) -> tuple[tuple[tuple[str, ...], str], ...]:
    """The layer specs of ``preset_model`` and ``partition_config``, merged as DeepSpeed merges them (the
    custom specs first, the preset's after them when ``use_default_specs``)."""
    preset: tuple[tuple[tuple[str, ...], str], ...] = ()
    if section.preset_model is not None:
        if section.preset_model not in PRESETS:
            raise NotSupportedError(
                f'tensor_parallel.preset_model "{section.preset_model}" splits fused projections into '
                "sub-parameters, which dsfunc's AutoTP does not yet; use partition_config layer_specs over separate "
                f"projections, or one of {sorted(PRESETS)}")
        preset = PRESETS[section.preset_model]
    custom = section.partition_config
    if custom is None:
        return preset
    specs = []
    for i, spec in enumerate(custom.get("layer_specs", ())):
        where = f"tensor_parallel.partition_config.layer_specs[{i}]"
        if spec.get("shape") is not None or spec.get("partition_dim") is not None:
            raise NotSupportedError(f"{where}: shape/partition_dim (sub-parameters of a fused projection) are not "
                                    "supported by dsfunc's AutoTP yet; split the projection or drop them")
        kind = str(spec.get("partition_type", "column")).lower()
        if kind not in ("column", "row", "skip"):
            raise InputError(f'{where}.partition_type is {kind!r}: use "column", "row" or "skip"')
        patterns = spec.get("patterns")
        if not patterns or isinstance(patterns, str):
            raise InputError(f"{where}.patterns must be a list of regexes over parameter names, got {patterns!r}")
        specs.append((tuple(patterns), kind))
    return (*specs, *preset) if custom.get("use_default_specs", True) else tuple(specs)


def _from_specs(model: nn.Module, specs: tuple[tuple[tuple[str, ...], str], ...]) -> dict[str, ParallelStyle]:
    """Linear modules whose weight's name a spec matches (the first spec that does), as their styles."""
    plan: dict[str, ParallelStyle] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = f"{path}.weight"
        kind = next((k for patterns, k in specs if any(re.match(p, weight) for p in patterns)), None)
        if kind is not None and kind != "skip":
            plan[path] = _SPEC_STYLES[kind]()
    return plan


def _hf_plan(model: nn.Module) -> dict[str, Any] | None:
    """The HF model's tp plan: its config's ``base_model_tp_plan`` (paths under the base model) merged with its
    class's and instance's ``_tp_plan`` (paths under the model), as DeepSpeed's ``_get_hf_tp_plan``."""
    config = getattr(model, "config", None)
    prefix = getattr(model, "base_model_prefix", "")
    merged: dict[str, Any] = {}
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if isinstance(base, Mapping):
        has_base = prefix and isinstance(getattr(model, prefix, None), nn.Module)
        merged.update({f"{prefix}.{k}" if has_base else k: v for k, v in base.items()})
    for plan in (getattr(type(model), "_tp_plan", None), model.__dict__.get("_tp_plan")):
        if isinstance(plan, Mapping):
            merged.update(plan)
    return merged or None


def _from_patterns(model: nn.Module, patterns: Plan, source: str) -> dict[str, ParallelStyle]:
    """Module paths matching a plan's keys (``*``: one path component), as torch styles (HF's style names or
    ParallelStyle objects); a tied output embedding stays whole (its weight is the input embedding's too)."""
    tied = _tied_paths(model)
    plan: dict[str, ParallelStyle] = {}
    compiled = [(re.compile(re.escape(k).replace(r"\*", r"[^.]+")), k, v) for k, v in patterns.items()]
    for path, _ in model.named_modules():
        for regex, key, style in compiled:
            if path and regex.fullmatch(path):
                if path not in tied:
                    plan[path] = _style(style, key, source)
                    if style == "vocab_parallel":
                        bind_loss(model, path)
                break
    return plan


def _style(style: str | ParallelStyle, key: str, source: str) -> ParallelStyle:
    if isinstance(style, ParallelStyle):
        return style
    make = _HF_STYLES.get(str(style))
    if make is None:
        raise NotSupportedError(f"{source}: {key!r} asks for the tp style {style!r}, which dsfunc does not apply "
                                f"yet; it applies {sorted(_HF_STYLES)} or a torch ParallelStyle")
    return make()


def _tied_paths(model: nn.Module) -> set[str]:
    """Modules holding a parameter that another module holds too (tied embeddings)."""
    holders: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(path)
    return {path for paths in holders.values() if len(paths) > 1 for path in paths}
