"""A script written against DeepSpeed's MoE API trains under dsfunc as under real DeepSpeed 0.19.8 (gloo, ZeRO
stage 0): at ep 2 on 2 ranks (the config's Adam, WarmupLR, top-1 with capacity) and ep 2 x dp 2 on 4 ranks
(a client SGD with Nesterov momentum, top-2 without dropping, Residual MoE), with one rank routing no token to
some experts. With clipping, the 4-rank run equals one process holding every expert (DeepSpeed's stage-0
clipping with experts averages the ranks' own norms, so it is not the reference there)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.multiprocess import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "experts", "scripts", "engine_compare.py")


def launch(ranks: int, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), SCRIPT, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()  # zeros: equal or not


def assert_same_runs(ranks: int, ours: str, theirs: str, *, norms: bool = False) -> None:
    """Each rank's runs ``ours`` and ``theirs`` (output prefixes) routed alike and agree: losses and ``l_aux``
    within 1e-5, every parameter within 1e-4 (and the steps' gradient norms within 1e-5, with ``norms``)."""
    for rank in range(ranks):
        got, want = torch.load(f"{ours}.rank{rank}.pt"), torch.load(f"{theirs}.rank{rank}.pt")
        assert got["counts"] == want["counts"]
        assert len(got["loss"]) == len(want["loss"]) > 0
        assert relative(torch.tensor(got["loss"]), torch.tensor(want["loss"])) < 1e-5, rank
        assert relative(torch.tensor(got["l_aux"]), torch.tensor(want["l_aux"])) < 1e-5, rank
        if norms:
            assert relative(torch.tensor(got["norm"]), torch.tensor(want["norm"])) < 1e-5, rank
        assert sorted(got["params"]) == sorted(want["params"])
        for name, value in want["params"].items():
            assert relative(got["params"][name], value) < 1e-4, (rank, name)


@pytest.mark.parametrize(("ranks", "case"), [(2, "adam"), (4, "sgd")])
def test_moe_script_trains_like_deepspeed(tmp_path, ranks, case):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    for backend in ("deepspeed", "dsfunc"):
        launch(ranks, "--backend", backend, "--case", case, "--starve", "--out", out)
    assert len(torch.load(f"{out}.dsfunc.rank0.pt")["loss"]) == (8 if case == "adam" else 4)
    assert_same_runs(ranks, f"{out}.dsfunc", f"{out}.deepspeed")
    starved = torch.load(f"{out}.dsfunc.rank1.pt")["counts"]
    assert all(0 in counts for counts in starved)  # rank 1 routed no token to some expert, every step


def test_clipped_moe_run_equals_one_process(tmp_path):
    out, reference = str(tmp_path / "run"), str(tmp_path / "one")
    args = ("--backend", "dsfunc", "--case", "sgd", "--clip", "0.05", "--seeded", "--starve")
    launch(4, *args, "--out", out)
    launch(1, *args, "--ep", "1", "--ranks", "4", "--out", reference)
    one = torch.load(f"{reference}.dsfunc.rank0.pt")
    assert min(one["norm"]) > 0.05 * 2  # clipping scales every step
    for rank in range(4):
        got = torch.load(f"{out}.dsfunc.rank{rank}.pt")
        assert relative(torch.tensor(got["norm"]), torch.tensor(one["norm"])) < 1e-5, rank
        assert relative(torch.tensor(got["loss"]), torch.tensor(one["loss"][rank::4])) < 1e-5, rank
        assert relative(torch.tensor(got["l_aux"]), torch.tensor(one["l_aux"][rank::4])) < 1e-5, rank
        for name, value in got["params"].items():
            if ".deepspeed_experts." in name:  # this rank's experts are the ep position's (rank % 2) pair
                head, tail = name.split(".deepspeed_experts.")
                index, rest = tail.split(".", 1)
                name = f"{head}.deepspeed_experts.{rank % 2 * 2 + int(index)}.{rest}"
            assert relative(value, one["params"][name]) < 1e-5, (rank, name)
