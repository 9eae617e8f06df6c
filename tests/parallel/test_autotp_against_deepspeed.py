"""DeepSpeed's AutoTP training script (``"tensor_parallel": {"autotp_size": 2}``, the model's own loss, the engine
API) under real DeepSpeed 0.19.8 on the CPU (gloo) and under dsfunc (``DSFUNC_AS_DEEPSPEED=1``): the same linear
weights split, and losses within 1e-5 and every parameter within 1e-4 (relative, norm-wise) of DeepSpeed's after every
step. tp 2 on 2 ranks (ZeRO 1, AdamW with clipping) and tp 2 x dp 2 on 4 ranks (ZeRO 2, SGD with momentum,
clipped: not scale-invariant, so a gradient or norm off by the tp or dp factor shows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.deepspeed.test_against_deepspeed import ROOT, launch
from tests.parallel import tp_runs as runs

SCRIPT = str(Path(ROOT) / "tests" / "parallel" / "autotp_compare.py")


@pytest.mark.parametrize(("ranks", "optimizer", "stage"), [(2, "adamw", 1), (4, "sgd", 2)],
                         ids=["tp2-adamw-zero1", "tp2xdp2-sgd-zero2"])
def test_autotp_script_trains_like_deepspeed_step_by_step(tmp_path, ranks, optimizer, stage):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    extra = ("--optimizer", optimizer, "--stage", str(stage))
    launch("deepspeed", out, SCRIPT, extra, ranks=ranks, timeout=900)
    launch("dsfunc", out, SCRIPT, extra, ranks=ranks, timeout=900, env={"DSFUNC_AS_DEEPSPEED": "1"})
    start = runs.llama().state_dict()
    for rank in range(ranks):
        ds, ours = (torch.load(f"{out}.{b}.rank{rank}.pt") for b in ("deepspeed", "dsfunc"))
        # both follow the model's tp plan; DeepSpeed's AutoTP replaces linear layers only, so the plan's
        # embedding_rowwise (the embedding's vocabulary split) is dsfunc's alone
        assert len(ds["split"]) == 15 and set(ours["split"]) - set(ds["split"]) == {"model.embed_tokens.weight"}
        assert set(ds["split"]) <= set(ours["split"]), (ours["split"], ds["split"])
        assert len(ours["losses"]) == len(ds["losses"]) == 2 * runs.STEPS
        assert ours["batch"] == ds["batch"] == [runs.GLOBAL_BATCH // 2 // ranks, 2]  # DeepSpeed's count: every rank
        assert max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], ds["losses"])) < 1e-5
        moved = torch.stack([(ds["params"][-1][k] - v).norm() for k, v in start.items()]).norm()
        assert moved > 1e-2 * torch.stack([v.norm() for v in start.values()]).norm()  # a wrong factor would show
        for step, (expected, got) in enumerate(zip(ds["params"], ours["params"], strict=True)):
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert (got[name] - value).norm() <= 1e-4 * value.norm(), (rank, step, name)
