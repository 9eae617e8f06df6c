"""ruff finds nothing anywhere in the tree: the library, tests, benchmarks, examples and notebooks; and the
package's names keep one word per concept.

ruff skips some folder names by default (``dist``, ``build``, ...); this lints the tree as it is, so a
package named like one of them would show up here as unlinted files.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean_on_the_whole_tree():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]


def test_ruff_sees_every_python_file():
    listed = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=True).stdout
    seen = {Path(line.strip()).resolve() for line in listed.splitlines() if line.strip().endswith((".py", ".ipynb"))}
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.ipynb"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    missing = sorted(p for p in tracked if (ROOT / p).resolve() not in seen)
    assert not missing, f"ruff does not lint: {missing}"


# words that named several things before (issue 44): a new name that uses one again gets a word of its own instead
RETIRED = {"slots": "ParamSlot's place in a unit's flat; a torch optimizer's per_unit state; the MoE buffers' rows",
           "pending": "work one waits for later is in flight (comm.InFlight)",
           "inflight": "in_flight"}
KEPT = {"__slots__", "INFLIGHT"}  # Python's; DeepSpeed's ZeroParamStatus.INFLIGHT


def test_retired_words_name_nothing_in_the_package():
    """No identifier of dsfunc (but the launcher's hostfile ``slots=N``, DeepSpeed's and MPI's word) is made of a
    retired word."""
    package = ROOT / "dsfunc"
    found = set()
    for path in package.rglob("*.py"):
        if path.is_relative_to(package / "launcher"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute)
                     else [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                     else [node.arg] if isinstance(node, (ast.arg, ast.keyword)) and node.arg else [])
            for name in set(names) - KEPT:
                words = {w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)}
                found.update(f"{path.relative_to(package).as_posix()}: {name} ({RETIRED[w]})" for w in words & RETIRED.keys())
    assert not found, sorted(found)
