"""The README's test command collects every test file (pytest skips folders such as ``dist`` and ``build``
by default: tests/dist once went unrun for weeks)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _test_command() -> str:
    """The README's second set-up command, the one that runs the tests."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme.split("## Two commands")[1], re.DOTALL)
    return commands[1]


def _normal(command: str) -> str:
    """A command as it runs, however spelled: ``python3`` is ``python``, ``python -m pip`` is ``pip``, pip's
    ``-q`` only quiets it."""
    command = command.strip().replace("python3 ", "python ")
    return command.replace("python -m pip ", "pip ").replace("pip install -q ", "pip install ")


def test_ci_runs_the_readme_test_command():
    steps = [_normal(s) for s in _test_command().split("&&")]
    ci = [_normal(line) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    position = [ci.index(step) if step in ci else -1 for step in steps]
    assert -1 not in position and position == sorted(position), (steps, ci)


def test_every_test_file_is_collected():
    pytest_args = _test_command().split("&&")[-1].split("pytest", 1)[1].split()
    pytest_args = [a for a in pytest_args if a not in ("-n", "2", "-q")]  # collection is the same without xdist
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.collected_files",
                          *pytest_args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    files = {str(p.relative_to(ROOT)) for pattern in ("test_*.py", "*_test.py") for p in (ROOT / "tests").rglob(pattern)}
    assert files - collected == set(), f"test files the README's command does not collect: {sorted(files - collected)}"
    assert len(collected) > 50  # the parse above read pytest's output
