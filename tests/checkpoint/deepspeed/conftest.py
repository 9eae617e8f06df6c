"""The DeepSpeed fixtures, unpacked once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.deepspeed.common import extract


@pytest.fixture(scope="session")
def ds_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one DeepSpeed ``save_dir`` per case (``common.CASES``) and ``gpt2``."""
    return extract(tmp_path_factory.mktemp("deepspeed"))
