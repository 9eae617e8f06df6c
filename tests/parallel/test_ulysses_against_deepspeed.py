"""DeepSpeed's ALST script (``register_with_transformers``, ``initialize(mpu=...)``, ``UlyssesSPDataLoaderAdapter``)
under dsfunc trains like real DeepSpeed 0.19.8 on the CPU and like one process: sp 2 and sp 2 x dp 2, AdamW with
clipping (config) and SGD with momentum (a client optimizer)."""

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


def launch(ranks: int, out: str, optimizer: str, *, dsfunc: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "DSFUNC_AS_DEEPSPEED")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **({"DSFUNC_AS_DEEPSPEED": "1"} if dsfunc
                                                                           else {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), SCRIPT, "--out", out, "--optimizer", optimizer]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [torch.load(f"{out}.rank{r}.pt") for r in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 4], ids=["sp2", "sp2xdp2"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_alst_script_trains_like_deepspeed_and_one_process(tmp_path, ranks, optimizer):
    pytest.importorskip("transformers")
    ours = launch(ranks, str(tmp_path / "dsfunc"), optimizer, dsfunc=True)
    _, want = one_process(ADAMW if optimizer == "adamw" else SGD,
                          [[rank_batch(s, r) for r in range(ranks)] for s in range(STEPS)])
    for run in ours:
        for name, value in want.items():
            assert ((run["params"][name] - value).norm() / value.norm()).item() < 1e-4, name
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    theirs = launch(ranks, str(tmp_path / "deepspeed"), optimizer, dsfunc=False)
    for got, expected in zip(ours, theirs, strict=True):
        assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], expected["losses"])) < 1e-5
        for name, value in expected["params"].items():
            assert ((got["params"][name] - value).norm() / value.norm()).item() < 1e-4, name
