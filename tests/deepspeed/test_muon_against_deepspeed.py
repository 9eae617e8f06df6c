"""``"type": "Muon"`` under real DeepSpeed 0.19.8 (CPU, gloo, 2 ranks) and under dsfunc, step by step, ZeRO 0-3.

DeepSpeed runs Newton-Schulz in fp16 where the CPU supports it (``ns_compute_dtype``) and in fp32 where it does
not; ``ONEDNN_MAX_CPU_ISA=AVX2`` makes this CPU one that does not, so both run the iteration in fp32 and agree to
float rounding. (In fp16, DeepSpeed's own updates differ from its fp32 ones by about 1e-3 of a parameter per
step here.) Clipping is compared at stage 0: DeepSpeed's ZeRO 1-3 clip Muon's orthogonalised update instead of
the gradients, a rule dsfunc does not follow (its one rule is DeepSpeed's stage 0's, at every stage).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.deepspeed.test_against_deepspeed import ROOT
from tests.deepspeed.test_against_deepspeed import launch as launch_ranks

SCRIPT = str(Path(ROOT) / "tests" / "deepspeed" / "scripts" / "muon_compare.py")


def launch(backend: str, out: str) -> None:
    launch_ranks(backend, out, SCRIPT, ("--clip", "0.3", "--clip_stages", "0"), timeout=900,
                 env={"TORCHDYNAMO_DISABLE": "1", "ONEDNN_MAX_CPU_ISA": "AVX2"})



def test_muon_trains_like_deepspeed_step_by_step(tmp_path):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    launch("deepspeed", out)
    launch("dsfunc", out)
    for rank in range(2):
        ds, ours = (torch.load(f"{out}.{b}.rank{rank}.pt") for b in ("deepspeed", "dsfunc"))
        assert sorted(ours) == [0, 1, 2, 3]
        for stage in ours:
            assert max(abs(a - b) for a, b in zip(ds[stage]["losses"], ours[stage]["losses"])) < 1e-5
            first = ds[stage]["params"][0]
            moved = max((first[k] - v).abs().max().item() for k, v in ds[stage]["params"][-1].items())
            assert moved > 1e-2  # the steps are large enough to show a wrong factor
            for t, (expected, got) in enumerate(zip(ds[stage]["params"], ours[stage]["params"])):
                diff = max((got[k] - v).abs().max().item() for k, v in expected.items())
                assert diff < 1e-5, (rank, stage, t, diff)
