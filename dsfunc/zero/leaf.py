"""ZeRO-3 leaf modules (DeepSpeed's ``deepspeed.utils.set_z3_leaf_modules`` family): a module gathered as one
unit, with no unit inside it.

A mixture-of-experts block runs only some of its experts per batch, and which ones differs between ranks;
gathering each expert when its forward starts would leave ranks waiting on different collectives.
Hugging Face (accelerate, transformers) marks such blocks as leaves; here a leaf becomes one unit of the
sharding plan (:func:`leaf_units`): every unit inside it merges into it, so its parameters are gathered
together when the leaf's forward starts, and nothing inside it is hooked. A leaf inside a unit is already
gathered whole with that unit. Units are also what stages 0-2 reduce gradients by, as backward produces
them, so a leaf merges its units at every stage: ranks that run different experts then reduce the same
units. The flag is the module's ``_z3_leaf`` attribute, as DeepSpeed's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from dsfunc.errors import InputError, InputTypeError

_FLAG = "_z3_leaf"


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` is a ZeRO-3 leaf."""
    return bool(getattr(module, _FLAG, False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to a leaf module that a ZeRO-3 state trains (DeepSpeed marks them at
    ``initialize``: ``param.ds_z3_leaf_module`` is the leaf)."""
    return hasattr(param, "ds_z3_leaf_module")


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (or unmark) ``model`` itself as a leaf."""
    setattr(model, _FLAG, flag)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The leaf modules in ``model`` (children before their parents, as DeepSpeed lists them)."""
    return [m for m in _post_order(model) if z3_leaf_module(m)]


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of the given classes as a leaf: a class (its subclasses too), its name, or its
    fully qualified name (``"transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"``).
    Returns the modules marked; none found is a ``ValueError`` unless ``raise_if_not_found=False``."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for the given classes; returns the modules unmarked."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules of the given paths (``""`` is ``model``); returns ``(modules, names not found)``."""
    by_name = dict(model.named_modules())
    return _flag_named(model, module_names, lambda want: [m for n, m in by_name.items() if n == want], flag,
                       raise_if_not_found, "named")


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose path ends with one of the suffixes, whole components (``"experts"`` matches
    ``layers.0.mlp.experts``, not ``layers.0.mlp.shared_experts``); returns ``(modules, suffixes not found)``."""
    named = list(model.named_modules())
    return _flag_named(model, module_name_suffixes,
                       lambda want: [m for n, m in named if n == want or n.endswith("." + want)], flag,
                       raise_if_not_found, "with the suffixes")


def leaf_units(model: nn.Module, unit_modules: Sequence[str]) -> list[str]:
    """``unit_modules`` with every unit inside a leaf merged into that leaf (the outermost one), which takes
    the place of the first of them. A leaf with no forward of its own (a ``ModuleList``, a ``ModuleDict``) or
    that is ``model`` itself leaves its parameters to the root unit, which is gathered for the whole step."""
    leaves = [path for path, m in model.named_modules() if z3_leaf_module(m)]

    def outermost_leaf(path: str) -> str | None:
        return next((leaf for leaf in leaves if leaf == "" or path.startswith(leaf + ".")), None)

    out: list[str] = []
    for path in unit_modules:
        leaf = outermost_leaf(path)
        if leaf is not None and (leaf == "" or isinstance(model.get_submodule(leaf), (nn.ModuleList, nn.ModuleDict))):
            continue
        keep = path if leaf is None else leaf
        if keep not in out:
            out.append(keep)
    return out


def mark_leaf_parameters(model: nn.Module) -> None:
    """Give each parameter of a leaf module DeepSpeed's ``ds_z3_leaf_module`` (a ZeRO-3 state trains them)."""
    for module in model.modules():
        if z3_leaf_module(module):
            for p in module.parameters():
                p.ds_z3_leaf_module = module


def _post_order(model: nn.Module) -> list[nn.Module]:
    out, seen = [], set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if id(module) not in seen:
            seen.add(id(module))
            out.append(module)

    visit(model)
    return out


def _flag_classes(model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise InputTypeError(f"leaf_module_classes must be a list of module classes or class names, got {classes!r}")

    def matches(module: nn.Module) -> bool:
        cls = type(module)
        return any(isinstance(module, c) if isinstance(c, type) else c in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
                   for c in classes)

    found = [m for m in _post_order(model) if matches(m)]
    if not found and raise_if_not_found:
        raise InputError(f"no modules of the classes {list(classes)} in the model ({type(model).__name__}); pass "
                         "classes it has, or raise_if_not_found=False")
    for m in found:
        set_z3_leaf_module(m, flag)
    return found


def _flag_named(model: nn.Module, wanted: Sequence[str], find: Callable[[str], list[nn.Module]], flag: bool,
                raise_if_not_found: bool, how: str) -> tuple[list[nn.Module], list[str]]:
    found, missing = [], []
    for want in wanted:
        modules = find(want)
        if not modules:
            missing.append(want)
        found += [m for m in modules if all(m is not f for f in found)]
    if missing and raise_if_not_found:
        raise InputError(f"no modules {how} {missing} in the model ({type(model).__name__}); its modules are "
                         f"{[n for n, _ in model.named_modules() if n][:20]}")
    for m in found:
        set_z3_leaf_module(m, flag)
    return found, missing
