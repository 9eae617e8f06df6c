"""dsfunc's version, pyproject.toml's (the one source): from the installed package's metadata, or, for a source tree
put on ``sys.path`` without installing it (as the GPU benchmarks run), from pyproject.toml beside the package."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def package_version() -> str:
    try:
        return importlib.metadata.version("dsfunc")
    except importlib.metadata.PackageNotFoundError:
        text = PYPROJECT.read_text() if PYPROJECT.is_file() else ""
        found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
        if found is None:
            raise ImportError(f"dsfunc is not installed and {PYPROJECT} does not name its version: install it "
                              "with `pip install -e .` from its source tree") from None
        return found.group(1)
