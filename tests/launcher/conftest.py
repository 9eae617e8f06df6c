"""The launch every local launcher test starts from."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launcher.scripts.harness import cli_env


@pytest.fixture
def job(tmp_path: Path):
    """(working dir, output dir, env) for one launch, with a private HOME."""
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    out.mkdir()
    return tmp_path, out, cli_env(home)
