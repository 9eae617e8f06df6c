"""DeepSpeed's module names under dsfunc, so that ``import dsfunc as deepspeed`` runs scripts as written.

A script's ``deepspeed.accelerator.get_accelerator()`` becomes ``dsfunc.accelerator.get_accelerator()``
and its ``from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus`` becomes
``from dsfunc.runtime...``: dsfunc answers DeepSpeed's module paths. :data:`ALIASES` maps the ones dsfunc
implements to the shells that implement them (the same module object: ``dsfunc.comm`` *is*
:mod:`dsfunc.deepspeed.comm`). Every other module under DeepSpeed's top-level packages
(:data:`PACKAGES`) imports as a stand-in whose public names import too and raise
:class:`~dsfunc.errors.NotSupportedError` naming the feature when called, so a script that imports
pipeline or MoE pieces at top level but never uses them runs, and one that uses them fails at the call,
never with an ImportError at import. dsfunc's own packages (``zero``, ``checkpoint``, ``monitor``,
``launcher``, ...) keep their names; DeepSpeed's ``zero.Init`` and ``zero.GatheredParameters`` live in
:mod:`dsfunc.zero`; DeepSpeed modules inside them that libraries import (``deepspeed.checkpoint.utils``,
``deepspeed.launcher.runner``) are aliases too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

from dsfunc.errors import unsupported

# DeepSpeed's module (below "deepspeed.") -> the dsfunc module implementing it
ALIASES = {
    "accelerator": "dsfunc.deepspeed.accelerator",
    "accelerator.real_accelerator": "dsfunc.deepspeed.accelerator",
    "comm": "dsfunc.deepspeed.comm",
    "comm.comm": "dsfunc.deepspeed.comm",
    "ops.adam": "dsfunc.deepspeed.ops",
    "ops.adam.fused_adam": "dsfunc.deepspeed.ops",
    "ops.adam.cpu_adam": "dsfunc.deepspeed.ops",
    "ops.lamb": "dsfunc.deepspeed.ops",
    "ops.adagrad": "dsfunc.deepspeed.ops",
    "ops.lion": "dsfunc.deepspeed.ops",
    "ops.op_builder": "dsfunc.deepspeed.op_builder",
    "utils": "dsfunc.deepspeed.utils",
    "utils.logging": "dsfunc.deepspeed.utils",
    "utils.timer": "dsfunc.deepspeed.timers",
    "utils.zero_to_fp32": "dsfunc.deepspeed.zero_to_fp32",
    "utils.torch": "dsfunc.deepspeed.torch_version",
    "runtime.utils": "dsfunc.deepspeed.utils",
    "runtime.dataloader": "dsfunc.deepspeed.utils",
    "runtime.engine": "dsfunc.deepspeed.engine",
    "runtime.zero": "dsfunc.zero",
    "runtime.zero.partition_parameters": "dsfunc.deepspeed.partition_parameters",
    "runtime.zero.stage_1_and_2": "dsfunc.deepspeed.zero_optimizer",
    "runtime.zero.stage3": "dsfunc.deepspeed.zero_optimizer",
    "zero.partition_parameters": "dsfunc.deepspeed.partition_parameters",
    "moe.utils": "dsfunc.deepspeed.moe",
    "moe.layer": "dsfunc.deepspeed.moe_layer",
    "moe.experts": "dsfunc.experts.local",
    "utils.groups": "dsfunc.deepspeed.expert_groups",
    "compression.helper": "dsfunc.deepspeed.compression",
    "checkpointing": "dsfunc.deepspeed.checkpointing",
    "runtime.activation_checkpointing.checkpointing": "dsfunc.deepspeed.checkpointing",
    "pipe": "dsfunc.deepspeed.pipe",
    "runtime.pipe": "dsfunc.deepspeed.pipe",
    "runtime.pipe.module": "dsfunc.deepspeed.pipe",
    "runtime.pipe.topology": "dsfunc.deepspeed.pipe",
    "runtime.pipe.engine": "dsfunc.deepspeed.pipe_engine",
    "runtime.lr_schedules": "dsfunc.deepspeed.lr_schedules",
    "runtime.sequence_parallel.ulysses_sp": "dsfunc.deepspeed.ulysses_sp",
    "sequence.layer": "dsfunc.deepspeed.sequence_layer",
    "runtime.config": "dsfunc.deepspeed.config",
    "runtime.precision_config": "dsfunc.deepspeed.precision_config",
    "runtime.swap_tensor": "dsfunc.deepspeed.swap_tensor",
    "runtime.zero.config": "dsfunc.deepspeed.zero_config",
    "runtime.zero.offload_config": "dsfunc.deepspeed.zero_config",
    "runtime.zero.leaf_module_config": "dsfunc.deepspeed.zero_config",
    "git_version_info": "dsfunc.deepspeed.git_version_info",
    # DeepSpeed's modules inside packages whose names are dsfunc's own (dsfunc.checkpoint, dsfunc.launcher)
    "checkpoint.utils": "dsfunc.deepspeed.checkpoint_utils",
    "launcher.runner": "dsfunc.deepspeed.runner",
    "profiling.flops_profiler": "dsfunc.monitor.flops_profiler",
    "profiling.flops_profiler.profiler": "dsfunc.monitor.flops_profiler",
}

# names of DeepSpeed's packages themselves that a module of dsfunc's answers (``deepspeed.ops.__compatible_ops__``)
PACKAGE_NAMES = {"ops": ("dsfunc.deepspeed.op_builder", ("__compatible_ops__",))}

# DeepSpeed's top-level packages dsfunc answers for (implemented in part, per ALIASES, or not at all)
PACKAGES = {
    "accelerator": "DeepSpeed's accelerator abstraction",
    "comm": "DeepSpeed's communication layer",
    "ops": "DeepSpeed's native ops",
    "utils": "a DeepSpeed utility",
    "runtime": "a part of DeepSpeed's runtime",
    "moe": "mixture of experts",
    "pipe": "pipeline parallelism",
    "compression": "model compression",
    "checkpointing": "DeepSpeed's activation checkpointing",
    "inference": "DeepSpeed inference",
    "module_inject": "kernel injection for inference",
    "model_implementations": "DeepSpeed's inference models",
    "profiling": "DeepSpeed's profilers",
    "elasticity": "elastic training",
    "autotuning": "autotuning",
    "sequence": "sequence parallelism",
    "linear": "DeepSpeed's optimized linear layers",
    "nvme": "NVMe offload",
    "compile": "DeepSpeed's torch.compile integration",
    "io": "DeepSpeed's I/O library",
    "datastates": "DataStates checkpointing",
    "env_report": "DeepSpeed's environment report",
    "git_version_info": "DeepSpeed's build information",
}

_PREFIX = "dsfunc."


def _deepspeed_path(fullname: str) -> str | None:
    """``"runtime.zero"`` for ``"dsfunc.runtime.zero"`` when that is under one of :data:`PACKAGES` or one of
    :data:`ALIASES`."""
    if not fullname.startswith(_PREFIX):
        return None
    path = fullname[len(_PREFIX):]
    return path if path in ALIASES or path.partition(".")[0] in PACKAGES else None


class _Loader(importlib.abc.Loader):
    """Loads an alias (the implementing module itself) or a stand-in module."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.spec: importlib.machinery.ModuleSpec | None = None  # an alias's own

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.path in ALIASES:
            module = importlib.import_module(ALIASES[self.path])
            self.spec = module.__spec__
            if not hasattr(module, "__path__"):  # so that DeepSpeed's submodules of it resolve (as stand-ins)
                module.__path__ = []
            return module
        return _stand_in(spec.name, self.path)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module is complete. An alias gets its own spec back (the import machinery set
        the alias's on it)."""
        if self.spec is not None:
            module.__spec__ = self.spec

    def get_code(self, fullname: str) -> types.CodeType | None:
        """The implementing module's code, for ``python -m``: runpy runs a package's ``__main__``, so
        ``<alias>.__main__`` is the alias's module run as a script (``python -m deepspeed.utils.zero_to_fp32``)."""
        target = ALIASES.get(self.path.removesuffix(".__main__"))
        spec = importlib.util.find_spec(target) if target is not None else None
        return spec.loader.get_code(target) if spec is not None and hasattr(spec.loader, "get_code") else None


class _Finder(importlib.abc.MetaPathFinder):
    """Finds DeepSpeed's module paths under ``dsfunc.`` (after the real modules: it sits last)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        where = _deepspeed_path(fullname)
        if where is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(where), is_package=not fullname.endswith(".__main__"))


def _stand_in(fullname: str, path: str) -> types.ModuleType:
    """A module for DeepSpeed's ``deepspeed.<path>``: its submodules import, its names are stand-ins."""
    module = types.ModuleType(fullname, f"Not in dsfunc: deepspeed.{path} ({PACKAGES[path.partition('.')[0]]}).")
    module.__path__ = []

    def attribute(name: str) -> Any:
        if path in PACKAGE_NAMES and name in PACKAGE_NAMES[path][1]:
            return getattr(importlib.import_module(PACKAGE_NAMES[path][0]), name)
        if name.startswith("_"):
            raise AttributeError(name)
        if f"{path}.{name}" in ALIASES:
            return importlib.import_module(f"{fullname}.{name}")
        return unsupported(f"deepspeed.{path}.{name}", PACKAGES[path.partition(".")[0]])

    module.__getattr__ = attribute  # type: ignore[method-assign]
    return module


def other_name(path: str, name: str) -> Any:
    """A name of DeepSpeed's ``deepspeed.<path>`` that the dsfunc module answering it lacks: a stand-in that
    imports and refuses when used, as in a module dsfunc does not implement (the module's ``__getattr__``)."""
    if name.startswith("_"):
        raise AttributeError(f"module 'deepspeed.{path}' has no attribute {name!r}")
    return unsupported(f"deepspeed.{path}.{name}", PACKAGES[path.partition(".")[0]])


def install() -> None:
    """Answer DeepSpeed's module paths under ``dsfunc.`` from now on (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())


def package(name: str) -> types.ModuleType:
    """``dsfunc.<name>`` for one of DeepSpeed's top-level packages (``dsfunc.__getattr__`` calls this)."""
    if name not in PACKAGES:
        raise AttributeError(f"module 'dsfunc' has no attribute {name!r}")
    return importlib.import_module(_PREFIX + name)


# DeepSpeed's top-level names dsfunc does not implement (``deepspeed.init_inference``, ...)
init_inference = unsupported("deepspeed.init_inference", "DeepSpeed inference", "run the model with torch")
InferenceEngine = unsupported("deepspeed.InferenceEngine", "DeepSpeed inference")
DeepSpeedHybridEngine = unsupported("deepspeed.DeepSpeedHybridEngine", "the hybrid (RLHF) engine")
DeepSpeedTransformerLayer = unsupported("deepspeed.DeepSpeedTransformerLayer", "DeepSpeed's fused transformer kernels")
DeepSpeedTransformerConfig = unsupported("deepspeed.DeepSpeedTransformerConfig", "DeepSpeed's fused transformer kernels")
add_tuning_arguments = unsupported("deepspeed.add_tuning_arguments", "the lr-schedule command-line flags",
                                   "describe the schedule in the config's scheduler section")
