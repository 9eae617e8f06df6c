"""Hugging Face Trainer and accelerate on dsfunc as their DeepSpeed (``DSFUNC_AS_DEEPSPEED=1``, no shim):
ZeRO-2 and ZeRO-3 on 1 and 2 gloo ranks, accumulation 2, Trainer's optimizer or the config's,
resume_from_checkpoint (dsfunc's checkpoints and the real DeepSpeed's), from_pretrained and from_config
under ZeRO-3 (a mixture of experts' blocks as ZeRO-3 leaves too), accelerate's loop (with save_state/load_state) and
``accelerate launch --use_deepspeed``: every loss equals the same run
without DeepSpeed within 1e-5 (ZeRO-3 from_config, whose weights ZeRO-3's own init draws: the real
DeepSpeed's run)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.deepspeed.hf.conftest import ROOT, base_env
from tests.multiprocess import free_port

RUNS = os.path.join(ROOT, "tests", "deepspeed", "hf", "runs.py")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
TOL = 1e-5


def run(args: list[str], env: dict[str, str], cwd: str, timeout: float = 280) -> dict:
    proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, check=False, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) >= 4, (got, want)
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOL, (got, want)


def test_trainer_on_one_rank(as_deepspeed, tmp_path):
    real = None
    if importlib.util.find_spec("deepspeed") is not None:  # the real DeepSpeed, on the host
        lone = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port())}  # else it takes 29500, which another run may hold
        real = run([sys.executable, RUNS, "real", str(tmp_path / "real")],
                   {**base_env(), **lone, "DS_ACCELERATOR": "cpu"}, str(tmp_path))
    checkpoint = [str(tmp_path / "real" / "z2o" / "checkpoint-2")] if real else []
    res = run([sys.executable, RUNS, "trainer", str(tmp_path / "ds"), *checkpoint], as_deepspeed, str(tmp_path))
    ref = res["reference"]
    for case in ("z2_trainer_optimizer", "z2_config_optimizer", "z3_trainer_optimizer", "z3_config_optimizer",
                 "z3_from_pretrained", "z2_resumed", "z3_resumed"):
        assert_close(res[case], ref)
    assert_close(res["z3_llama_from_pretrained"], res["llama_reference"])  # buffers built under zero.Init
    assert_close(res["z3_mixtral_from_pretrained"], res["mixtral_reference"])  # its MoE blocks ZeRO-3 leaves
    if real is not None:
        assert_close(real["z2_config_optimizer"], ref)
        assert_close(res["resumed_from_deepspeed"], ref)  # its 2 parameter groups, its torch scheduler
        assert_close(res["z3_from_config"], real["z3_from_config"])


def test_trainer_on_two_ranks(as_deepspeed, tmp_path):
    res = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), RUNS, "trainer", str(tmp_path)], as_deepspeed, str(tmp_path))
    for case in ("z2_trainer_optimizer", "z3_config_optimizer", "z3_from_pretrained", "z2_resumed", "z3_resumed"):
        assert_close(res[case], res["reference"])  # DDP's


def test_accelerate_loop_and_launch(as_deepspeed, tmp_path):
    res = run([sys.executable, RUNS, "accelerate", str(tmp_path)], as_deepspeed, str(tmp_path))
    ref = res["reference"]
    for stage in ("z2", "z3"):  # then save_state halfway, load_state at the end and the second half again
        assert_close(res[stage], ref + ref[len(ref) // 2:])
    assert_close(res["z3_mixtral"], res["mixtral_reference"])
    launched = run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--main_process_port",
                    str(free_port()), "--use_deepspeed", "--zero_stage", "3", "--gradient_accumulation_steps", "2",
                    "--gradient_clipping", "1.0", RUNS, "launched"], as_deepspeed, str(tmp_path))
    assert_close(launched["launched"], res["launch_reference"])
