"""dsfunc's version, pyproject.toml's (the one source): from the installed package's metadata, or, for a source tree
put on ``sys.path`` without installing it (as the GPU benchmarks run), from pyproject.toml beside the package."""

from __future__ import annotations

import functools
import importlib.metadata
import re
import subprocess
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


def version_parts(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a version such as ``0.4.1`` or ``0.4.1.dev0`` (DeepSpeed's
    ``__version_major__``, ...); a part that is not a number reads as 0."""
    parts = [int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", version)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


@functools.cache
def git_info() -> tuple[str, str]:
    """``(commit, branch)`` of the git checkout dsfunc runs from (DeepSpeed's ``__git_hash__`` and
    ``__git_branch__``), or ``"[none]"`` for each, as DeepSpeed says without build information."""
    def ask(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(PYPROJECT.parent), *args], capture_output=True, text=True,
                                 timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return "[none]"
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "[none]"

    return ask("rev-parse", "--short", "HEAD"), ask("rev-parse", "--abbrev-ref", "HEAD")
