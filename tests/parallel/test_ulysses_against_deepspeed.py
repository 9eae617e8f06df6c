"""DeepSpeed's ALST script (``register_with_transformers``, ``initialize(mpu=...)``, ``UlyssesSPDataLoaderAdapter``)
under dsfunc gets real DeepSpeed 0.19.8's gradient on the CPU, for both losses a script combines over the sp group:
the ALST tutorial's (the ranks' token sums through a differentiable all-reduce: every rank backpropagates the whole
mean) and Hugging Face Trainer's (each rank backpropagates its own tokens' share of the mean). DeepSpeed sums the sp
ranks' gradients at ZeRO 0-2 and averages them at ZeRO-3 ([Note: the gradient over sp] in
:mod:`dsfunc.distributed.mesh`), so against one process the gradient norm is ``scale`` times one process's: the
ALST loss's is sp times at ZeRO-2, Trainer's is one process's at ZeRO-1, the ALST loss's at ZeRO-3 too. Each run's
losses, grad norms (before clipping) and final parameters equal DeepSpeed's, and one process's where the scale is 1;
the clipping thresholds lie inside the norms' range (some steps clip, others not) and one case runs SGD with
momentum, so a gradient off by a constant factor shows in the parameters as well as in the norms.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.multiprocess import free_port
from tests.parallel.ulysses_setup import ADAMW, SGD, STEPS, one_process, rank_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "parallel", "ulysses_compare.py")
SP = 2


def launch(ranks: int, out: str, optimizer: str, *flags: str, dsfunc: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "DSFUNC_AS_DEEPSPEED")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if dsfunc:
        env["DSFUNC_AS_DEEPSPEED"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), SCRIPT, "--out", out, "--optimizer", optimizer, *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [torch.load(f"{out}.rank{r}.pt") for r in range(ranks)]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def worst(got: list[float], want: list[float], scale: float = 1.0) -> float:
    return max(abs(a - scale * b) / abs(scale * b) for a, b in zip(got, want, strict=True))


# (ranks, optimizer, loss, ZeRO stage, the gradient's scale against one process); each at one mesh shape and
# optimizer, as the suite's budget allows
CASES = [(2, "sgd", "share", 1, 1), (4, "adamw", "alst", 2, SP), (2, "sgd", "alst", 3, 1)]


@pytest.mark.parametrize(("ranks", "optimizer", "loss", "stage", "scale"), CASES,
                         ids=["trainer-loss-zero1-sgd-sp2", "alst-loss-zero2-adamw-sp2xdp2", "alst-loss-zero3-sgd-sp2"])
def test_alst_script_gets_deepspeeds_gradient(tmp_path, ranks, optimizer, loss, stage, scale):
    pytest.importorskip("transformers")
    flags = ("--loss", loss, "--stage", str(stage))
    ours = launch(ranks, str(tmp_path / "dsfunc"), optimizer, *flags, dsfunc=True)
    losses, want, norms = one_process(ADAMW if optimizer == "adamw" else SGD,
                                      [[rank_batch(s, r) for r in range(ranks)] for s in range(STEPS)])
    same = STEPS if scale == 1 else 1  # a scaled gradient leaves one process's path after the first step
    for run in ours:
        assert worst(run["norms"][:same], norms[:same], scale) < 1e-5, (run["norms"], norms)
        if scale == 1:
            for name, value in want.items():
                assert relative(run["params"][name], value) < 1e-4, name
    # every replica's loss of a step, averaged, is the one-process step's loss (a mean over equal micro-batches)
    per_step = sum(torch.tensor(ours[r]["losses"]).view(STEPS, SP) for r in range(0, ranks, SP))
    assert worst((per_step.sum(1) / ranks).tolist()[:same], losses[:same]) < 1e-5

    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    theirs = launch(ranks, str(tmp_path / "deepspeed"), optimizer, *flags, dsfunc=False)
    for got, expected in zip(ours, theirs, strict=True):
        assert worst(got["losses"], expected["losses"]) < 1e-5
        assert worst(got["norms"], expected["norms"]) < 1e-5
        for name, value in expected["params"].items():
            assert relative(got["params"][name], value) < 1e-4, name
