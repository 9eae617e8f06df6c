"""The restructured code trains bit for bit like the code the baseline was recorded with."""

from __future__ import annotations

import pytest

from tests.baseline import bitwise


def test_every_stage_precision_and_api_matches_the_recorded_parameters():
    recorded = bitwise.records().get(bitwise.machine())
    if recorded is None:
        pytest.skip(f"no baseline recorded for {bitwise.machine()} (recorded: {sorted(bitwise.records())}); "
                    "see tests/baseline/bitwise.py for how to record one")
    runs = bitwise.measure()
    assert runs.keys() == recorded.keys()
    changed = [name for name in runs if runs[name] != recorded[name]]
    assert not changed, f"parameters or losses differ from the recorded baseline in {changed}"
