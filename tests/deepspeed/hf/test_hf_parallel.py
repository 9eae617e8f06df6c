"""Hugging Face Trainer reaches dsfunc's mesh through the DeepSpeed config and accelerate's ParallelismConfig:
``"tensor_parallel": {"autotp_size": 2}`` (Trainer calls ``deepspeed.tp_model_init``, accelerate feeds both tp
ranks the same batches) and ``parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed")`` (accelerate
registers Ulysses attention, passes the mpu to ``initialize``, wraps the loader in ``UlyssesSPDataLoaderAdapter``;
Trainer reduces the loss over ``deepspeed.utils.groups._get_sequence_parallel_group()``). On 2 gloo ranks the
logged losses equal a one-process Trainer run without DeepSpeed within 1e-5.

The logged gradient norms equal one process's too, under dsfunc and under real DeepSpeed 0.19.8, at ZeRO-1 and
(dsfunc) ZeRO-3: Trainer's loss gives each sp rank its own tokens' share of the mean, which the sp ranks' gradients
add up to at ZeRO 0-2, and sp times that at ZeRO-3 for DeepSpeed below 0.20.2, whose ZeRO-3 averages them ([Note:
the gradient over sp] in :mod:`dsfunc.distributed.mesh`). A gradient 1/sp or sp times one process's halves or
doubles the norm, which Adam's update barely shows in the losses.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

import dsfunc
from dsfunc.deepspeed.autotp import check_recorded
from tests.deepspeed.hf.conftest import ROOT
from tests.deepspeed.hf.runs import LLAMA
from tests.deepspeed.hf.test_hf import assert_close, run
from tests.multiprocess import free_port

RUNS = os.path.join(ROOT, "tests", "deepspeed", "hf", "parallel_runs.py")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@functools.cache
def trainer_run(kind: str, env: tuple, cwd: str) -> dict:
    """One run of parallel_runs.py (``reference`` in one process, else on 2 ranks), once per session."""
    ranks = [] if kind == "reference" else ["-m", "torch.distributed.run", "--nproc_per_node", "2",
                                            "--master_port", str(free_port())]
    return run([sys.executable, *ranks, RUNS, kind, os.path.join(cwd, kind)], dict(env), cwd, timeout=600)


@pytest.fixture(scope="module")
def runs(as_deepspeed, tmp_path_factory):
    cwd = str(tmp_path_factory.mktemp("hf_parallel"))
    return lambda kind: trainer_run(kind, tuple(sorted(as_deepspeed.items())), cwd)


def test_trainer_with_autotp_trains_like_one_process(runs):
    tp = runs("tp")
    assert_close(tp["losses"], runs("reference")["losses"])
    assert_close(tp["grad_norms"], runs("reference")["grad_norms"])
    assert tp["q_proj_rows"] == LLAMA.hidden_size // 2  # split over the 2 ranks, not 2 data-parallel replicas


def test_trainer_with_parallelism_config_sp_trains_like_one_process(runs, as_deepspeed, tmp_path):
    reference = runs("reference")
    assert_close(runs("sp")["losses"], reference["losses"])
    assert_close(runs("sp")["grad_norms"], reference["grad_norms"])
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    real = {k: v for k, v in as_deepspeed.items() if k != "DSFUNC_AS_DEEPSPEED"} | {"DS_ACCELERATOR": "cpu"}
    theirs = trainer_run("sp", tuple(sorted(real.items())), str(tmp_path))
    assert_close(theirs["losses"], reference["losses"])
    assert_close(theirs["grad_norms"], reference["grad_norms"])


def test_trainer_sp_at_zero3_trains_like_one_process(runs):
    # Trainer multiplies its sp loss by sp at ZeRO-3 for DeepSpeed below 0.20.2, whose ZeRO-3 averages the sp ranks'
    # gradients: dsfunc answers as 0.19.8 and averages there too
    assert_close(runs("sp-zero3")["losses"], runs("reference")["losses"])
    assert_close(runs("sp-zero3")["grad_norms"], runs("reference")["grad_norms"])


def test_tp_model_init_records_and_initialize_checks():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(dsfunc.InputError, match="tp_size 2 conflicts with the config's tensor_parallel.autotp_size 4"):
        dsfunc.tp_model_init(model, 2, torch.float32, config={"tensor_parallel": {"autotp_size": 4}})
    assert dsfunc.tp_model_init(model, 2, torch.float32) is model
    check_recorded(model, 2)
    with pytest.raises(dsfunc.InputError, match='set "tensor_parallel": {"autotp_size": 2} in the config'):
        check_recorded(model, 0)
