"""Every module of the dsfunc package, found from its files (namespace folders included)."""

from __future__ import annotations

import importlib
import pathlib
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[1]


def dsfunc_modules() -> list[ModuleType]:
    names = []
    for path in sorted((ROOT / "dsfunc").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return [importlib.import_module(name) for name in names]
