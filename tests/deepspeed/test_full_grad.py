"""``deepspeed.utils.safe_get_full_grad`` / ``safe_set_full_grad`` under real DeepSpeed 0.19.8 (CPU, gloo, 2 ranks)
and under dsfunc: the same gradients after every backward at ZeRO stages 0-3 (this rank's own off the boundary at
0-1, reduced at the boundary and at every micro-batch at 3, a ValueError off the boundary at 2), None for a frozen
parameter, and a set gradient (``safe_set_full_grad``, ``safe_update_full_grad_vectorized``) read back."""

from __future__ import annotations

import pytest
import torch

from tests.deepspeed.test_against_deepspeed import ROOT, launch

SCRIPT = f"{ROOT}/tests/deepspeed/scripts/ds_full_grad.py"


def test_full_grad_as_deepspeed(tmp_path):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    launch("deepspeed", out, script=SCRIPT)
    launch("dsfunc", out, script=SCRIPT)
    local = {}
    for rank in range(2):
        ds, ours = (torch.load(f"{out}.{b}.rank{rank}.pt") for b in ("deepspeed", "dsfunc"))
        assert sorted(ours) == [0, 1, 2, 3]
        for stage, expected in ds.items():
            assert [isinstance(v, str) for v in ours[stage]] == [isinstance(v, str) for v in expected], stage
            for i, (mine, theirs) in enumerate(zip(ours[stage], expected)):
                if isinstance(theirs, str):
                    assert mine == theirs, (rank, stage, i)
                else:
                    assert (mine - theirs).abs().max() <= 1e-6 * theirs.abs().max(), (rank, stage, i)
        local[rank] = ours[0][0]
        assert all(v.count("frozen: None") == 4 for v in ours.values())
    assert not torch.equal(local[0], local[1])  # off the boundary at stage 0 each rank reads its own


def test_full_grad_with_the_optimizer_offloaded_as_deepspeed(tmp_path):
    """With offload_optimizer the reduced gradients go to the host as they are made; the helper reads them back, and
    a set one comes back to the device until the step, which applies it (clipping off: see the script). Off
    the boundary at stages 2-3 DeepSpeed answers what its host buffer held (zeros before the first step's boundary,
    then the last step's gradient) where dsfunc answers this step's sum so far: those reads are checked on
    DeepSpeed's side only."""
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    launch("deepspeed", out, script=SCRIPT, extra=("--offload",))
    launch("dsfunc", out, script=SCRIPT, extra=("--offload",))
    for rank in range(2):
        ds, ours = (torch.load(f"{out}.{b}.rank{rank}.pt") for b in ("deepspeed", "dsfunc"))
        assert sorted(ours) == sorted(ds) == [1, 2, 3]
        for stage, expected in ds.items():
            assert [isinstance(v, str) for v in ours[stage]] == [isinstance(v, str) for v in expected], stage
            for i, (mine, theirs) in enumerate(zip(ours[stage], expected)):
                if isinstance(theirs, str):
                    assert mine == theirs, (rank, stage, i)
                elif stage >= 2 and i in (0, 4):  # after the first backward of each step: off the boundary
                    assert torch.equal(theirs, torch.zeros_like(theirs) if i == 0 else expected[2]), (rank, stage, i)
                else:
                    assert (mine - theirs).abs().max() <= 1e-6 * theirs.abs().max(), (rank, stage, i)
