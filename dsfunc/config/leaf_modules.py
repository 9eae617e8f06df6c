"""``zero_optimization.leaf_module``: which modules ZeRO treats as leaves (:mod:`dsfunc.zero.leaf`), by class, path
or path suffix, as DeepSpeed's config names them; :func:`dsfunc.init_state` marks them before it plans the units."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsfunc.config.errors import _bad, _unknown

# DeepSpeed 0.19.8's defaults: Hugging Face's mixture-of-experts blocks, whose experts run only for some tokens
DEFAULT_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
_KEYS = ("classes", "names", "name_suffixes")


@dataclass(frozen=True)
class LeafModules:
    """The modules to mark as leaves: classes (their names or fully qualified names), module paths, and path
    suffixes (whole components)."""

    classes: tuple[str, ...] = DEFAULT_CLASSES
    """Module classes, by ``__name__`` or fully qualified name; DeepSpeed's default: the HF MoE blocks above."""
    names: tuple[str, ...] = ()
    """Module paths in the model (``model.layers.3.mlp``), as ``named_modules`` gives them."""
    name_suffixes: tuple[str, ...] = ()
    """Path endings, matched on whole components (``mlp`` marks ``layers.0.mlp``, not ``layers.0.gate_mlp``)."""


def leaf_modules(value: Any, path: str) -> LeafModules:
    """The section (null: the defaults); each list may be given as one string, and repeats count once."""
    if value is None:
        return LeafModules()
    if not isinstance(value, Mapping):
        raise _bad(path, value, 'a JSON object with "classes", "names" and "name_suffixes"')
    fields = {}
    for key, given in value.items():
        if key not in _KEYS:
            raise _unknown(path, key, list(_KEYS), list(_KEYS))
        items = [given] if isinstance(given, str) else given
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise _bad(f"{path}.{key}", given, "a string or a list of strings")
        fields[key] = tuple(dict.fromkeys(items))
    return LeafModules(**fields)
