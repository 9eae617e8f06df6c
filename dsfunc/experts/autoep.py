"""AutoEP: a Hugging Face MoE model's sparse blocks replaced, in place, by expert-parallel ones when the state is
built, as DeepSpeed's ``initialize`` does from the config's ``expert_parallel`` section.

A preset names the HF block class of a model family (its number of experts is its expert weights' first dim); the
block's router is kept and its fused expert weights (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``)
are sliced along dim 0, each rank keeping the experts of its place in its expert-parallel group (DeepSpeed's "E + D"
arrangement, :mod:`dsfunc.experts.groups`). Every rank builds the whole model alike (same seed or weights), so the
slices together are the model's experts; each expert-data-parallel group then holds one replica of a slice.
"""

from __future__ import annotations

from torch import nn

from dsfunc.config.expert_parallel import PRESETS, ExpertParallelConfig
from dsfunc.distributed import comm
from dsfunc.distributed.mesh import Mesh
from dsfunc.errors import InputError, NotSupportedError
from dsfunc.experts.ep_block import ExpertParallelBlock
from dsfunc.experts.grouped import GroupedExperts
from dsfunc.experts.groups import ExpertGroups, make_expert_groups
from dsfunc.experts.layer import MoE
from dsfunc.experts.shared import SharedExpertParallelBlock

# the model families AutoEP knows, by the class of their sparse blocks (a router ``gate``, fused ``experts``, and
# DeepSeek's ``shared_experts``); each router returns ``(logits, weights, experts)``: DeepSeek's, with its
# group-limited top-k, sigmoid scores (V3) and routed scaling, routes as in the HF model
_BLOCK_CLASSES = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock",
                  "deepseek_v2": "DeepseekV2Moe", "deepseek_v3": "DeepseekV3MoE"}


def _preset_of(model: nn.Module, config: ExpertParallelConfig) -> str:
    """The preset the config names, or the one of ``model.config.model_type``."""
    if config.preset_model is not None:
        return config.preset_model
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _BLOCK_CLASSES:
        raise InputError(f"expert_parallel is enabled but {type(model).__name__} (model_type={model_type!r}) is "
                         f"no model family AutoEP knows ({', '.join(PRESETS)}): {_moe_like(model)}; set "
                         "expert_parallel.preset_model if its blocks are one of these families', or disable AutoEP")
    return model_type


def _moe_like(model: nn.Module) -> str:
    """The model's modules that look like mixture-of-experts blocks (by class name), for an error."""
    found = [f"{path} ({type(m).__name__})" for path, m in model.named_modules()
             if any(word in type(m).__name__.lower() for word in ("moe", "expert"))]
    return "its modules that look like MoE: " + ", ".join(found[:6]) if found else "it has no module named like MoE"


def _blocks(model: nn.Module, name: str) -> dict[str, nn.Module]:
    """The model's blocks of preset ``name`` (those replaced before included), by path; an error naming the modules
    when there is none."""
    found = {path: m for path, m in model.named_modules()
             if type(m).__name__ == _BLOCK_CLASSES[name] or isinstance(m, ExpertParallelBlock)}
    if not found:
        raise InputError(f"expert_parallel: the {name!r} preset replaces {_BLOCK_CLASSES[name]} modules, and "
                         f"{type(model).__name__} has none ({_moe_like(model)}): pick the preset of the model's "
                         f"family ({', '.join(PRESETS)}) or disable AutoEP")
    return found


def apply_autoep(model: nn.Module, config: ExpertParallelConfig, tp: comm.Group | None = None) -> list[str]:
    """Replace ``model``'s MoE blocks by :class:`ExpertParallelBlock` over ``config.autoep_size`` ranks (a
    collective: every rank calls it, with the same model); returns the replaced paths ([] when AutoEP is off).
    ``tp``: the mesh's tensor-parallel ranks, which share each block's tokens out (:mod:`dsfunc.experts.ep_block`)."""
    if not config.enabled:
        return []
    name = _preset_of(model, config)
    blocks = _blocks(model, name)
    size, world = config.autoep_size, comm.world_size()
    for path, block in blocks.items():
        num_experts = _num_experts(block)
        if num_experts % size:
            divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
            raise InputError(f"num_experts={num_experts} of the {name} block {path} is not divisible by "
                             f"expert_parallel.autoep_size={size}: each rank holds num_experts / autoep_size "
                             f"experts; choose autoep_size among {divisors}")
    if world % size:
        raise InputError(f"expert_parallel.autoep_size={size} does not divide the world size {world}: launch a "
                         f"multiple of {size} ranks or choose an autoep_size that divides {world}")
    groups = make_expert_groups(size)
    for path, block in blocks.items():
        if not isinstance(block, ExpertParallelBlock):
            block = _replacement(block, groups, fused=config.use_grouped_mm)
            model.set_submodule(path, block)
        elif block.groups.ep_size != size:
            raise InputError(f"{path} was split over {block.groups.ep_size} ranks by an earlier state, not "
                             f"expert_parallel.autoep_size={size}: build the model again to split it differently")
        block.tp = tp or comm.Group.lone()
    return list(blocks)


def check_expert_mesh(model: nn.Module, config: ExpertParallelConfig, mesh: Mesh) -> None:
    """What expert parallelism does not compose with on the mesh, refused by name: DeepSpeed's MoE layer under
    tensor parallelism, and any MoE under sequence parallelism."""
    layers = any(isinstance(m, MoE) for m in model.modules())
    if layers and mesh.size("tp") > 1:
        raise NotSupportedError(
            f"deepspeed.moe.layer.MoE with tensor_parallel.autotp_size {mesh.size('tp')} is not supported by dsfunc "
            "yet: its gate and all-to-all would take every tp rank's copy of the tokens. What composes with tp is "
            "AutoEP (expert_parallel.enabled) on a Hugging Face Qwen3-MoE or Mixtral; the MoE layer composes with "
            "ZeRO 0-3 over data parallelism at autotp_size 1")
    if (layers or config.enabled) and mesh.size("sp") > 1:
        raise NotSupportedError(
            f"mixture-of-experts layers with sequence_parallel_size {mesh.size('sp')} are not supported by dsfunc "
            "yet: the router's load-balancing loss is a function of all of a batch's tokens, and each sp rank "
            "routes its part of the sequence only (the sequence-parallel loss has no load-balancing term either). "
            "Drop sequence_parallel_size; expert parallelism composes with tensor_parallel.autotp_size (AutoEP) "
            "and ZeRO 0-3")


def _num_experts(block: nn.Module) -> int:
    return block.num_experts if isinstance(block, ExpertParallelBlock) else block.experts.gate_up_proj.size(0)


def _replacement(block: nn.Module, groups: ExpertGroups, *, fused: bool) -> ExpertParallelBlock:
    """``block``'s router and this rank's slice of its experts."""
    num_experts = _num_experts(block)
    local = num_experts // groups.ep_size
    first = groups.ep_ranks.index(comm.rank()) * local
    source = block.experts
    experts = GroupedExperts(source.gate_up_proj.detach()[first:first + local].clone(),
                             source.down_proj.detach()[first:first + local].clone(), source.act_fn, fused=fused)
    for mine, theirs in ((experts.gate_up_proj, source.gate_up_proj), (experts.down_proj, source.down_proj)):
        mine.requires_grad_(theirs.requires_grad)
        mine.allreduce, mine.group_name = False, groups.name  # DeepSpeed's marks of an expert parameter
    routed = ExpertParallelBlock(block.gate, experts, num_experts, groups, getattr(block, "jitter_noise", 0.0))
    shared = getattr(block, "shared_experts", None)
    return routed if shared is None else SharedExpertParallelBlock(routed, shared)


def expert_units(model: nn.Module) -> dict[str, ExpertGroups]:
    """The experts of the model's expert-parallel blocks, by path, with their groups: each a unit of its own, its
    gradients reduced over its expert-data-parallel ranks."""
    return {f"{path}.experts": m.groups for path, m in model.named_modules() if isinstance(m, ExpertParallelBlock)}
