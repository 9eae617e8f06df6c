"""DeepSpeed's MoE layer under dsfunc gives real DeepSpeed 0.19.8's outputs, l_aux, expert counts and gradients:
top-1 (with and without random token selection, RSample and Jitter noise), top-2, top-3, without token dropping,
Residual MoE and eval capacity, at ep 2 on 2 ranks and ep 2 x dp 2 on 4 ranks (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.multiprocess import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "experts", "scripts", "layer_compare.py")


def launch(out: str, ranks: int, ep: int, *, as_dsfunc: bool) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "DSFUNC_AS_DEEPSPEED")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if as_dsfunc:
        env["DSFUNC_AS_DEEPSPEED"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), SCRIPT, out, str(ep)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and (got - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("ranks", [2, 4])
def test_moe_layer_equals_deepspeeds(tmp_path, ranks):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    launch(str(tmp_path / "ds"), ranks, 2, as_dsfunc=False)
    launch(str(tmp_path / "ours"), ranks, 2, as_dsfunc=True)
    for rank in range(ranks):
        theirs, ours = (torch.load(tmp_path / f"{who}.rank{rank}.pt") for who in ("ds", "ours"))
        assert sorted(ours) == sorted(theirs)
        for case, want in theirs.items():
            got = ours[case]
            assert got["names"] == want["names"], case
            assert torch.equal(got["counts"], want["counts"]), (rank, case)
            for key in ("out", "l_aux", "x_grad"):
                assert close(got[key], want[key]), (rank, case, key)
            assert sorted(got["grads"]) == sorted(want["grads"]), (rank, case)
            for name, grad in want["grads"].items():
                assert close(got["grads"][name], grad), (rank, case, name)
