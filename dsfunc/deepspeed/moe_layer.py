"""``deepspeed.moe.layer``: DeepSpeed's ``MoE`` is dsfunc's (:class:`dsfunc.experts.MoE`), its process groups kept in
DeepSpeed's registry (``deepspeed.utils.groups``, :mod:`dsfunc.deepspeed.expert_groups`)."""

from __future__ import annotations

from dsfunc.deepspeed import expert_groups
from dsfunc.experts import layer


class MoE(layer.MoE):
    __doc__ = layer.MoE.__doc__

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Bind the layer to the registry's groups of its ep size, made if new (a collective: every rank calls
        it), as ``deepspeed.initialize`` does for each MoE layer."""
        self.bind(expert_groups.groups_of(self.ep_size, data_first=use_data_before_expert_parallel_))


def bind_all(model: object) -> None:
    """What ``deepspeed.initialize`` does first: every MoE layer of ``model`` without groups gets the registry's."""
    for module in model.modules():
        if isinstance(module, layer.MoE) and module.expert_groups is None:
            module.bind(expert_groups.groups_of(module.ep_size))
