"""Which parameters the engine trains, and in which parameter group: DeepSpeed's ``model_parameters``.

``initialize(model_parameters=...)`` takes what a torch optimizer takes: parameters (a list, generator
or ``filter``), or a list of param-group dicts with their own options (``{"params": [...],
"weight_decay": 0.0}``), as every Hugging Face / DeepSpeed-Chat / nanoGPT script passes to exclude biases
and norms from weight decay. The model's other parameters are frozen. Groups become a
:class:`~dsfunc.ParamGroups` labelled ``group0``, ``group1``, ... in the given order (DeepSpeed's
``param_groups`` order); a group's options override the config optimizer's params for it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from dsfunc.errors import InputError, InputTypeError
from dsfunc.optim.groups import ParamGroups

logger = logging.getLogger("dsfunc")

Groups = list[tuple[list[torch.Tensor], dict[str, Any]]]  # (parameters, options) per group, in order


def parameter_groups(model_parameters: Any) -> Groups:
    """``model_parameters`` as groups: one group without options for plain parameters, else one per dict."""
    plain: list[torch.Tensor] = []
    groups: Groups = []
    for i, item in enumerate(model_parameters):
        if isinstance(item, dict):
            if "params" not in item:
                raise InputError(f"model_parameters[{i}] is a dict without a 'params' entry")
            params = item["params"]
            groups.append(([params] if isinstance(params, torch.Tensor) else list(params),
                           {k: v for k, v in item.items() if k != "params"}))
        elif isinstance(item, torch.Tensor):
            plain.append(item)
        else:
            hint = " (model.named_parameters() gives (name, tensor) pairs; pass model.parameters())" \
                if isinstance(item, tuple) else ""
            raise InputTypeError(f"model_parameters[{i}] is a {type(item).__name__}, not a parameter{hint}")
    if plain and groups:
        raise InputTypeError("model_parameters mixes parameters and param-group dicts; put the parameters in a "
                             "group of their own: {'params': [...]}")
    return groups or [(plain, {})]


def labelled(model: nn.Module, groups: Groups) -> ParamGroups:
    """The groups as :class:`ParamGroups` over the model's parameter names (``group0``, ``group1``, ...)."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    label: dict[str, str] = {}
    for i, (params, _) in enumerate(groups):
        for p in params:
            name = names[id(p)]
            if label.setdefault(name, f"group{i}") != f"group{i}":
                raise InputError(f"parameter {name!r} is in param groups {label[name][5:]} and {i}; "
                                 "put each parameter in one group")
    return ParamGroups(label=label, options={f"group{i}": options for i, (_, options) in enumerate(groups)})


def freeze_all_but(model: nn.Module, trainable: list[torch.Tensor], what: str) -> None:
    """Set ``requires_grad=False`` on the model's parameters that are not in ``trainable``."""
    ids = {id(p) for p in trainable}
    named = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    strangers = [p for p in trainable if id(p) not in named]
    if strangers:
        raise InputError(
            f"{what} holds {len(strangers)} tensor(s) that are not parameters of the model "
            f"(shapes {[tuple(p.shape) for p in strangers[:4]]}); pass parameters of the model you train"
        )
    frozen = [name for name, p in model.named_parameters() if id(p) not in ids and p.requires_grad]
    for name, p in model.named_parameters():
        if id(p) not in ids:
            p.requires_grad_(False)
    if frozen:
        logger.info("%s leaves out %d parameter(s); they are frozen: %s", what, len(frozen), frozen[:8])
