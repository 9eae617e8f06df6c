"""``deepspeed.ops.op_builder`` and ``deepspeed.ops.__compatible_ops__``: which of DeepSpeed's native ops dsfunc
answers.

Scripts (and DeepSpeed's own tests) ask ``deepspeed.ops.__compatible_ops__[FusedAdamBuilder.NAME]`` or
``CPUAdamBuilder().is_compatible()`` before using an op. dsfunc answers true for the optimizers whose DeepSpeed
classes it has (:mod:`dsfunc.deepspeed.ops`: they run dsfunc's own update, nothing to build) and false for every
other op; ``load()`` is refused: a script uses those classes, not the compiled module.
"""

from __future__ import annotations

from typing import Any

from dsfunc.errors import NotSupportedError


class OpBuilder:
    """DeepSpeed's builder of one native op: its ``NAME`` and whether dsfunc has it."""

    NAME = ""
    USE: str = ""  # the class a script uses instead of the compiled module

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True) -> Any:
        raise NotSupportedError(f"{type(self).__name__}().load(): dsfunc builds no DeepSpeed op; use {self.USE}, "
                                "which runs dsfunc's own update")


def _builder(class_name: str, name: str, use: str) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {"NAME": name, "USE": use, "__doc__": f"``{name}``: dsfunc has {use}."})


FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam", "deepspeed.ops.adam.FusedAdam")
CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam", "deepspeed.ops.adam.DeepSpeedCPUAdam")
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb", "deepspeed.ops.lamb.FusedLamb")
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad", "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad")
BUILT = (FusedAdamBuilder, CPUAdamBuilder, FusedLambBuilder, CPUAdagradBuilder)


class _Absent(OpBuilder):
    """A builder of an op dsfunc does not have: not compatible, and ``load()`` says so."""

    def is_compatible(self, verbose: bool = False) -> bool:
        return False

    def load(self, verbose: bool = True) -> Any:
        raise NotSupportedError(f"{type(self).__name__}: dsfunc does not have this DeepSpeed op")


def __getattr__(name: str) -> type[OpBuilder]:
    """DeepSpeed's other builders (``InferenceBuilder``, ``AsyncIOBuilder``, ...) import, and are not compatible."""
    if name.endswith("Builder") and not name.startswith("_"):
        return type(name, (_Absent,), {"NAME": name})
    raise AttributeError(f"module 'deepspeed.ops.op_builder' has no attribute {name!r}")


class _CompatibleOps(dict):
    """Op name -> whether dsfunc has it: false for any op not listed."""

    def __missing__(self, name: str) -> bool:
        return False


__compatible_ops__ = _CompatibleOps({builder.NAME: True for builder in BUILT})
