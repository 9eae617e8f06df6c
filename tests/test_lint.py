"""ruff finds nothing anywhere in the tree: the library, tests, benchmarks, examples and notebooks.

ruff skips some folder names by default (``dist``, ``build``, ...); this lints the tree as it is, so a
package named like one of them would show up here as unlinted files.
"""

from __future__ import annotations

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
