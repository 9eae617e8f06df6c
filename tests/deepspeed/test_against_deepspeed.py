"""The same engine-API script under real DeepSpeed 0.19.8 (CPU, gloo) and under dsfunc: an unseeded model, ZeRO
stages 0-3 on 2 ranks, gradient accumulation, clipping and WarmupLR give DeepSpeed's losses and parameters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.multiprocess import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "deepspeed", "scripts", "ds_compare.py")


def launch(backend: str, out: str, script: str = SCRIPT, extra: tuple[str, ...] = (), *,
           env: dict[str, str] | None = None, timeout: float = 600, ranks: int = 2) -> None:
    """Run ``script`` on ``ranks`` gloo ranks under ``backend`` ("deepspeed" or "dsfunc"), writing ``out``;
    ``env``: more variables for the ranks."""
    ranks_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    ranks_env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port()),
           script, "--backend", backend, "--out", out, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=ranks_env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{backend} exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def both_sides(tmp_path, script: str) -> list[tuple[dict, dict]]:
    """``script`` run on 2 gloo ranks under real DeepSpeed, then under dsfunc: per rank, (DeepSpeed's record,
    dsfunc's)."""
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    launch("deepspeed", out, script=script)
    launch("dsfunc", out, script=script)
    return [tuple(torch.load(f"{out}.{b}.rank{rank}.pt") for b in ("deepspeed", "dsfunc")) for rank in range(2)]


def test_dsfunc_trains_like_deepspeed_at_every_stage(tmp_path):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    launch("deepspeed", out)
    launch("dsfunc", out)
    for rank in range(2):
        ds, ours = (torch.load(f"{out}.{b}.rank{rank}.pt") for b in ("deepspeed", "dsfunc"))
        assert sorted(ours) == [0, 1, 2, 3]
        for stage in ours:
            expected, got = torch.tensor(ds[stage]["losses"]), torch.tensor(ours[stage]["losses"])
            assert len(got) == 20 and ((got - expected).abs() / expected.abs()).max() < 1e-5, (rank, stage)
            # engine.backward returns the loss divided by the accumulation steps (DeepSpeed's gas_scaled_loss)
            expected, got = torch.tensor(ds[stage]["returned"]), torch.tensor(ours[stage]["returned"])
            assert ((got - expected).abs() / expected.abs()).max() < 1e-5, (rank, stage)
            for name, value in ds[stage]["params"].items():
                mine = ours[stage]["params"][name]
                assert ((mine - value).abs().max() / value.abs().max()) < 1e-5, (rank, stage, name)
        # rank 0's initial weights won on both ranks: the ranks hold one model
        assert all(torch.equal(v, torch.load(f"{out}.dsfunc.rank0.pt")[0]["params"][k])
                   for k, v in ours[0]["params"].items())
