"""The DeepSpeed pipeline script (a PipelineModule whose embedding and head are one TiedLayerSpec,
``engine.train_batch``) under real DeepSpeed 0.19.8 (CPU, gloo) and under dsfunc: 2 stages on 2 ranks, and
2 stages x 2 replicas on 4, give DeepSpeed's losses and parameters.

Clipping is off here: DeepSpeed's fp32 pipeline clips by the norm of the first stage's gradients only
(``clip_grad_norm_`` counts a parameter on model-parallel rank 0, which the pipeline grid makes stage 0), where
dsfunc clips by the whole model's norm (tested against one process in test_functional.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.multiprocess import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "pipeline", "pipe_compare.py")


def launch(backend: str, ranks: int, out: str, *flags: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), SCRIPT, "--backend", backend, "--out", out, *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{backend} exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("ranks, flags", [(2, ()), (4, ()), (2, ("--training-data",)),
                                          (2, ("--training-data", "--stages", "1"))],
                         ids=["2 stages", "2 stages x 2 replicas", "DeepSpeedExamples' pattern", "1 stage x 2 replicas"])
def test_pipeline_engine_trains_like_deepspeeds(tmp_path, ranks, flags):
    """The third case is DeepSpeedExamples' training/pipeline_parallelism shape: built layers with a lambda
    between them, a criterion module, ``training_data=`` and ``engine.train_batch()`` with no iterator; the
    fourth the same with ``-p 1``: one stage, data parallel over its two replicas through the pipeline API."""
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    launch("deepspeed", ranks, out, *flags)
    launch("dsfunc", ranks, out, *flags)
    stages = int(flags[-1]) if "--stages" in flags else 2
    for rank in range(ranks):
        ds, ours = (torch.load(f"{out}.{b}.rank{rank}.pt") for b in ("deepspeed", "dsfunc"))
        assert ours["stage"] == ds["stage"] == rank // (ranks // stages)
        assert (ours["first"], ours["last"]) == (ds["first"], ds["last"]) == (ours["stage"] == 0,
                                                                              ours["stage"] == stages - 1)
        assert len(ours["losses"]) == 7
        assert max(abs(a - b) for a, b in zip(ours["losses"], ds["losses"])) < 1e-5, rank
        assert abs(ours["eval"] - ds["eval"]) < 1e-5, rank
        assert sorted(ours["params"]) == sorted(ds["params"])  # the same layers on the same stage, same names
        for name, value in ds["params"].items():
            assert (ours["params"][name] - value).abs().max() < 1e-4, (rank, name)
    if not flags:  # it trains, and the tied embedding's copies on the first and last stage stayed equal
        assert ours["losses"][-1] < ours["losses"][0] - 1
        first, last = (torch.load(f"{out}.dsfunc.rank{r}.pt")["params"] for r in (0, ranks - 1))
        assert torch.equal(first["tied_modules.embed.weight"], last["tied_modules.embed.weight"])
