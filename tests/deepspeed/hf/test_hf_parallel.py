"""Hugging Face Trainer reaches dsfunc's tensor parallelism through the DeepSpeed config it is given
(``"tensor_parallel": {"autotp_size": 2}``: Trainer calls ``deepspeed.tp_model_init``, accelerate feeds both tp
ranks the same batches): on 2 gloo ranks its logged losses equal a one-process Trainer run without DeepSpeed
within 1e-5."""

from __future__ import annotations

import os
import sys

import pytest

from tests.deepspeed.hf.conftest import ROOT
from tests.deepspeed.hf.runs import LLAMA
from tests.deepspeed.hf.test_hf import assert_close, run
from tests.multiprocess import free_port

RUNS = os.path.join(ROOT, "tests", "deepspeed", "hf", "parallel_runs.py")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_trainer_with_autotp_trains_like_one_process(as_deepspeed, tmp_path):
    ref = run([sys.executable, RUNS, "reference", str(tmp_path)], as_deepspeed, str(tmp_path))
    tp = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
              str(free_port()), RUNS, "tp", str(tmp_path)], as_deepspeed, str(tmp_path), timeout=600)
    assert_close(tp["losses"], ref["losses"])
    assert tp["q_proj_rows"] == LLAMA.hidden_size // 2  # split over the 2 ranks, not 2 data-parallel replicas
