"""The restructured code trains bit for bit like the code the baseline was recorded with."""

from __future__ import annotations

import json

import pytest
import torch

from tests.baseline import bitwise


def test_every_stage_precision_and_api_matches_the_recorded_parameters():
    recorded = json.loads(bitwise.RECORD.read_text())
    if recorded["torch"] != torch.__version__:
        pytest.skip(f"the baseline was recorded with torch {recorded['torch']}; this is {torch.__version__}")
    runs = bitwise.measure()
    assert runs.keys() == recorded["runs"].keys()
    changed = [name for name in runs if runs[name] != recorded["runs"][name]]
    assert not changed, f"parameters or losses differ from the recorded baseline in {changed}"
