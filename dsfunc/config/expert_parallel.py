"""The ``expert_parallel`` section: DeepSpeed's AutoEP, which swaps a Hugging Face model's mixture-of-experts blocks
for expert-parallel ones when the engine is built (:mod:`dsfunc.experts.autoep`).

DeepSpeed 0.19.8 reads these keys in ``module_inject/auto_ep_config.py`` (``parse_autoep_config``). dsfunc reads
``enabled``, ``autoep_size``, ``preset_model`` and ``use_grouped_mm``; the keys that tune DeepSpeed's own kernels,
communication backends or routing overrides are accepted at their defaults only (the model's router decides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsfunc.config.checks import _accepted, _bool, _choice, _integer, _only, _optional, _string
from dsfunc.config.errors import _bad
from dsfunc.config.schema import _key, _section

PRESETS = ("qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3")
"""The presets dsfunc applies (Hugging Face's fused-expert Qwen3-MoE, Mixtral and DeepSeek-V2/V3 blocks)."""
DEEPSPEED_ONLY_PRESETS = ("qwen3_5_moe", "minimax_m3")


def _preset(value: Any, path: str) -> str:
    text = _string(value, path)
    if text in DEEPSPEED_ONLY_PRESETS:
        raise _bad(path, value, "one of " + ", ".join(f'"{p}"' for p in PRESETS) + f" (DeepSpeed's {text!r} preset "
                   "is not implemented by dsfunc)")
    if text not in PRESETS:
        raise _bad(path, value, "one of " + ", ".join(f'"{p}"' for p in PRESETS) + " (or leave it out: the "
                   "preset is then chosen by the model's config.model_type)")
    return text


@dataclass(frozen=True)
class ExpertParallelConfig:
    """``expert_parallel``: whether the model's MoE blocks are replaced, and over how many ranks their experts
    are split."""

    enabled: bool = _key(False, _bool)
    """Replace every MoE block AutoEP knows when the state (or engine) is built."""
    autoep_size: int = _key(1, _integer(ge=1))
    """Ranks each block's experts are split over (it must divide the world size and each block's number of
    experts): blocks of that many consecutive ranks, whatever ``tensor_parallel.autotp_size`` is (DeepSpeed's
    AutoEP+AutoTP folding); the strided rest of the world holds replicas (expert data parallelism)."""
    preset_model: str | None = _key(None, _optional(_preset))
    """Which model family's blocks to replace; by default the one ``model.config.model_type`` names."""
    use_grouped_mm: bool = _key(True, _bool)
    """Run the local experts with one grouped matmul (``torch._grouped_mm``) where it takes the shapes;
    False, or shapes it does not take: one matmul per expert over its rows."""


def _fixed(default: Any) -> Any:
    return _only(default, feature="this AutoEP option",
                 fix="dsfunc keeps the model's own router and expert layout, so only DeepSpeed's default applies.")


_FIXED = {
    "expert_tensor_parallel_size": _fixed(1),
    # DeepSpeed's check that a tp group's ranks routed alike: dsfunc's run one router on the same tokens
    "validate_folding_routing": _accepted(_bool),
    "async_split_plan": _fixed(False),
    "moe_layer_pattern": _fixed(None),
    "expert_pattern": _fixed(None),
    "router_pattern": _fixed(None),
    "disable_triton_grouped_mm": _accepted(_bool),  # dsfunc has no Triton grouped GEMM to disable
    "route_norm": _fixed(None),
    "route_scale": _fixed(1.0),
    "score_apply": _fixed("auto"),
    "combine_impl": _accepted(_choice("auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm")),
    "row_weighting_impl": _accepted(_choice("auto", "eager", "fused")),
    "gate_up_impl": _accepted(_choice("separate", "fused")),
    "comm_backend": _fixed("comm"),
    "comm_num_sm": _accepted(_integer(ge=0)),  # DeepEP only
    "comm_qp_margin": _accepted(_integer(ge=0)),  # DeepEP only
    "comm_max_tokens_per_rank": _accepted(_integer(ge=0)),  # DeepEP only
    "num_expert_groups": _fixed(None),
    "num_limited_groups": _fixed(None),
    "score_func": _fixed("auto"),
    "top_k": _fixed("auto"),
    "load_balance_coeff": _fixed(None),
    "routed_scaling_factor": _fixed("auto"),
    "expert_w1": _fixed(None),
    "expert_w2": _fixed(None),
    "expert_w3": _fixed(None),
    "num_experts_attr": _fixed(None),
    "top_k_attr": _fixed(None),
    "has_shared_experts": _fixed(None),
    "shared_experts_pattern": _fixed(None),
    "shared_experts_gate_pattern": _fixed(None),
    "expert_activation": _fixed(None),
}
_expert_parallel = _section(ExpertParallelConfig, _FIXED)


def parse_expert_parallel(section: Any) -> ExpertParallelConfig:
    """An ``expert_parallel`` section, validated and completed as inside a whole config."""
    return _expert_parallel(section, "expert_parallel")
