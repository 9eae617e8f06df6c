"""``"type": "Muon"`` under real DeepSpeed 0.19.8 (CPU, gloo, 2 ranks) and under dsfunc, step by step, ZeRO 0-3.

Both run Newton-Schulz as DeepSpeed's default ``"gram"`` does, in fp16 where the CPU has it (``ns_compute_dtype``)
and in fp32 where it does not. At stage 0 both hand Newton-Schulz the same fp32 momentum, so in fp16 they agree to
float rounding. DeepSpeed's ZeRO 1-3 reach Muon's momentum by another path of rounding (last bits of fp32), which
fp16 Newton-Schulz turns into differences of about 1e-3 of a parameter per step here; so stages 1-3 are compared
with ``ONEDNN_MAX_CPU_ISA=AVX2``, which makes this CPU one without fp16 and both sides run the iteration in fp32.
Clipping is compared at stage 0: DeepSpeed's ZeRO 1-3 clip Muon's orthogonalised update instead of the gradients,
a rule dsfunc does not follow (its one rule is DeepSpeed's stage 0's, at every stage).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.deepspeed.test_against_deepspeed import ROOT
from tests.deepspeed.test_against_deepspeed import launch as launch_ranks

SCRIPT = str(Path(ROOT) / "tests" / "deepspeed" / "scripts" / "muon_compare.py")
RUNS = {  # stages -> the ranks' extra environment
    "0": {},
    "1,2,3": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def launch(backend: str, out: str, stages: str) -> None:
    launch_ranks(backend, f"{out}.{stages}", SCRIPT, ("--clip", "0.3", "--clip_stages", "0", "--stages", stages),
                 timeout=900, env={"TORCHDYNAMO_DISABLE": "1", **RUNS[stages]})


def test_muon_trains_like_deepspeed_step_by_step(tmp_path):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    for stages in RUNS:
        launch("deepspeed", out, stages)
        launch("dsfunc", out, stages)
    for rank in range(2):
        ds, ours = ({} for _ in range(2))
        for stages in RUNS:
            ds.update(torch.load(f"{out}.{stages}.deepspeed.rank{rank}.pt"))
            ours.update(torch.load(f"{out}.{stages}.dsfunc.rank{rank}.pt"))
        assert sorted(ours) == sorted(ds) == [0, 1, 2, 3]
        for stage in ours:
            assert max(abs(a - b) for a, b in zip(ds[stage]["losses"], ours[stage]["losses"])) < 1e-5
            first = ds[stage]["params"][0]
            moved = max((first[k] - v).abs().max().item() for k, v in ds[stage]["params"][-1].items())
            assert moved > 1e-2  # the steps are large enough to show a wrong factor
            for t, (expected, got) in enumerate(zip(ds[stage]["params"], ours[stage]["params"])):
                diff = max((got[k] - v).abs().max().item() for k, v in expected.items())
                assert diff < (2e-6 if stage == 0 else 1e-5), (rank, stage, t, diff)
