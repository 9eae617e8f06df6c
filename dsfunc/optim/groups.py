"""Parameter groups: optimizer options for groups of parameters, named by a label function over their names.

DeepSpeed and torch.optim take groups as a list of dicts (``{"params": [...], "weight_decay": 0.0}``;
the DeepSpeed engine translates those). The functional API names them the optax way, a label per
parameter (``optax.multi_transform``'s labels, here over parameter names) and options per label::

    groups = dsfunc.ParamGroups(
        label=lambda name: "no_decay" if name.endswith("bias") or "norm" in name else "decay",
        options={"no_decay": {"weight_decay": 0.0}},
    )
    state = dsfunc.init_state(model, config, param_groups=groups)

A group's options override the config optimizer's ``params`` for its parameters (``lr``, ``betas``,
``eps``, ``weight_decay``, ... — validated as the config is). The lr schedule runs per group from the
group's lr, as DeepSpeed's schedulers do: WarmupLR without ``warmup_max_lr`` warms each group up to its
own lr, while one with ``warmup_max_lr`` (and WarmupDecayLR, OneCycle, LRRangeTest) sets every group to
the same lr. The plan puts each group's parameters of a module in a unit of their own
(:func:`~dsfunc.zero.layout.make_plan`); one group only is the same as no groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from dsfunc.errors import InputError

GROUP_METADATA = ("name", "names", "param_names", "moe")  # keys scripts put in a group to name or mark it (DeepSpeed's MoE split: "moe"); no option


def plain(value: Any) -> Any:
    """Python numbers and lists for tensors and tuples (what a torch optimizer's param_groups hold)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class ParamGroups:
    """Parameter groups: ``label(name) -> group`` for every trainable parameter (or a mapping from names),
    and ``options[group]``, the optimizer options of a group (groups without options take the config's).

    The groups' order (DeepSpeed's ``param_groups`` order, e.g. of ``get_lr()``) is ``options``' order,
    then the other labels as the parameters first use them.
    """

    label: Callable[[str], str] | Mapping[str, str]
    options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def label_of(self, name: str) -> str:
        """The group of parameter ``name``."""
        if callable(self.label):
            return self.label(name)
        if name not in self.label:
            raise InputError(f"ParamGroups: parameter {name!r} has no label; the mapping must name every "
                             "trainable parameter (or pass a function of the name)")
        return self.label[name]

    def order(self, names: Iterable[str]) -> list[str]:
        """The groups that ``names`` (the trainable parameters) fall in, in the groups' order."""
        used = list(dict.fromkeys(self.label_of(n) for n in names))
        return [g for g in self.options if g in used] + [g for g in used if g not in self.options]
