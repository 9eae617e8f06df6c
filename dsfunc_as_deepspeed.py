"""``DSFUNC_AS_DEEPSPEED=1``: dsfunc answers as DeepSpeed, so libraries built on DeepSpeed (Hugging Face
``Trainer``, accelerate) run on dsfunc with no change.

With the variable set when the interpreter starts, ``import deepspeed`` is ``import dsfunc``, every
``deepspeed.X`` is ``dsfunc.X`` (the same module objects as dsfunc's DeepSpeed namespace,
:mod:`dsfunc.deepspeed.namespace`), and ``importlib.metadata`` finds a ``deepspeed`` distribution of
version :data:`VERSION`, so availability and version checks pass. Without it nothing changes, and a
real DeepSpeed installed beside dsfunc imports as usual.

``dsfunc_as_deepspeed.pth``, installed with dsfunc (regular or editable install), runs :func:`from_environment`
at every interpreter start; the ``dsfunc`` launcher sets the variable for every rank. This module uses
the standard library only and imports nothing of dsfunc until ``deepspeed`` is imported, so an
interpreter that never imports it pays nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys
import types
from typing import Any

VARIABLE = "DSFUNC_AS_DEEPSPEED"

# The DeepSpeed release whose surface dsfunc answers, marked as dsfunc's by its local label
VERSION = "0.19.8+dsfunc"

_METADATA = f"""Metadata-Version: 2.1
Name: deepspeed
Version: {VERSION}
Summary: dsfunc, answering as DeepSpeed ({VARIABLE}=1)
"""


def enabled(environ: Any = None) -> bool:
    """Whether the variable asks for the switch: ``1`` on, unset, empty or ``0`` off."""
    value = (os.environ if environ is None else environ).get(VARIABLE, "")
    if value not in ("", "0", "1"):
        print(f"dsfunc: ignoring {VARIABLE}={value!r}: set it to 1 (dsfunc answers as DeepSpeed) or 0",
              file=sys.stderr)
    return value == "1"


class _AsDsfunc(importlib.abc.Loader):
    """Loads ``deepspeed.X`` as the module ``dsfunc.X`` itself (not a copy)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run; the import machinery set the alias's spec on the module: give it its own back."""
        module.__spec__ = self.spec

    def get_code(self, fullname: str) -> types.CodeType | None:
        """``dsfunc.X``'s code, for ``python -m deepspeed.X`` (runpy asks the loader for it)."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target) if spec is not None and hasattr(spec.loader, "get_code") else None


class _Distribution(importlib.metadata.Distribution):
    """``deepspeed``'s metadata, answered by dsfunc."""

    def read_text(self, filename: str) -> str | None:
        return _METADATA if filename == "METADATA" else None

    def locate_file(self, path: Any) -> Any:
        import pathlib

        return pathlib.Path(__file__).parent / path


class Finder(importlib.abc.MetaPathFinder):
    """Answers ``deepspeed`` and ``deepspeed.*`` imports and metadata ahead of any installed DeepSpeed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _AsDsfunc("dsfunc" + fullname[len("deepspeed"):]),
                                              is_package=not fullname.endswith(".__main__"))  # runpy's rule

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        """``deepspeed`` for a search of this interpreter's path (not for tools that scan a given folder, as
        pip does: they must see what is installed there)."""
        name = getattr(context, "name", None)
        if getattr(context, "path", sys.path) is not sys.path:
            return []
        if name is None or re.sub(r"[-_.]+", "-", name).lower() == "deepspeed":
            return [_Distribution()]
        return []


def install() -> None:
    """Answer as DeepSpeed from now on (idempotent; an already imported real DeepSpeed stays)."""
    if not any(type(f).__name__ == "Finder" and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.insert(0, Finder())


def from_environment() -> None:
    """:func:`install` when the variable is set (what the ``.pth`` file runs)."""
    if enabled():
        install()
