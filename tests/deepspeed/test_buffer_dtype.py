"""``data_types.buffer_dtype`` under real DeepSpeed 0.19.8 (CPU, gloo, 2 ranks) and under dsfunc: the module's floating
buffers take that dtype (its integer ones keep theirs) at ZeRO stages 0 and 3, and two bf16 steps (SGD with momentum)
give the same losses and parameters."""

from __future__ import annotations

import pytest
import torch

from tests.deepspeed.test_against_deepspeed import ROOT, both_sides

SCRIPT = f"{ROOT}/tests/deepspeed/scripts/ds_buffer_dtype.py"


def test_buffer_dtype_as_deepspeed(tmp_path):
    for rank, (ds, ours) in enumerate(both_sides(tmp_path, SCRIPT)):
        assert sorted(ours) == sorted(ds)
        for case, expected in ds.items():
            got = ours[case]
            assert {k: d for k, (d, _) in got["buffers"].items()} == {k: d for k, (d, _) in expected["buffers"].items()}
            assert got["buffers"]["inv_freq"][0] == f"torch.{'bfloat16' if case[0] == 'bf16' else 'float16'}", case
            assert torch.equal(got["buffers"]["positions"][1], expected["buffers"]["positions"][1])
            if case[0] == "bf16":  # dsfunc's forward reads floating buffers in the compute dtype, as bf16 ones are
                assert torch.equal(got["buffers"]["inv_freq"][1], expected["buffers"]["inv_freq"][1]), (rank, case)
                assert got["losses"] == pytest.approx(expected["losses"], rel=1e-2), (rank, case)
                for name, value in expected["params"].items():
                    diff = (got["params"][name] - value).abs().max() / value.abs().max()
                    assert diff < 2e-2, (rank, case, name)
