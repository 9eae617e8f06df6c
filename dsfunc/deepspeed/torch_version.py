"""``deepspeed.utils.torch``: ``required_torch_version``, the check scripts and tests gate torch-version-dependent
code on. torch's own version type (``torch.__version__``) compares with version strings, as ``packaging`` does."""

from __future__ import annotations

from typing import Any

import torch

from dsfunc.deepspeed.namespace import other_name
from dsfunc.errors import InputError


def required_torch_version(min_version: Any = None, max_version: Any = None) -> bool:
    """Whether the installed torch is at least ``min_version`` and at most ``max_version`` (numbers or strings,
    ``2.1`` or ``"2.1.0"``; the local part counts, so ``2.13.0+cpu`` is above ``2.13``), as DeepSpeed's."""
    if not (min_version or max_version):
        raise InputError("required_torch_version needs min_version= or max_version= (or both)")
    installed = torch.__version__
    if min_version and installed < str(min_version):
        return False
    return not (max_version and installed > str(max_version))


def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of ``deepspeed.utils.torch`` import, and refuse when used."""
    return other_name("utils.torch", name)
