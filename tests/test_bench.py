"""The benchmark script runs every system it compares (a CPU smoke run: 2 gloo ranks, a tiny GPT)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.multiprocess import free_port

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ["dsfunc:2", "dsfunc:3", "fsdp2", "fsdp2c", "deepspeed:2", "deepspeed:3"]


def test_bench_zero_runs_every_system_on_gloo_ranks():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(ROOT / "bench" / "bench_zero.py"), "--device", "cpu",
           "--model", "tiny", "--systems", ",".join(SYSTEMS), "--warmup", "1", "--steps", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| tiny |")]
    assert [r[2].strip() for r in rows] == ["dsfunc ZeRO-2", "dsfunc ZeRO-3", "PyTorch FSDP2",
                                           "PyTorch FSDP2 + compiled blocks", "DeepSpeed ZeRO-2",
                                           "DeepSpeed ZeRO-3"], proc.stdout
    for row in rows:
        first, last = (float(x) for x in row[6].split("->"))
        assert math.isfinite(first) and math.isfinite(last) and float(row[3].replace(",", "")) > 0


def test_bench_single_runs_every_kind_of_system():
    systems = ["plain", "plain+compile", "plain+ckpt", "plain+fused", "dsfunc", "dsfunc+compile", "dsfunc+units",
               "dsfunc+selective", "dsfunc+graph", "dsfunc+fused", "dsfunc+zero3+compile+units", "dsfunc+zero3+units+tiled",
               "dsfunc+fused+muon"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-W", "ignore", str(ROOT / "bench" / "bench_single.py"), "--device", "cpu",
           "--model", "tiny", "--systems", ",".join(systems), "--warmup", "1", "--steps", "1", "--accum", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| tiny |")]
    assert [r[1].strip() for r in rows] == systems
    first_losses = {r[1].strip(): float(r[6].split("->")[0]) for r in rows}
    # every dsfunc variant computes the same first step's loss, the mean over 2 micro-batches (checkpointing, compiling,
    # graphs, the fused loss, tiling change no math; Muon moves the weights after it), and so does every plain one
    # (the compiled model with its loss inside, the fused loss)
    assert len({round(v, 4) for k, v in first_losses.items() if k.startswith("dsfunc")}) == 1, first_losses
    assert len({round(v, 4) for k, v in first_losses.items() if k.startswith("plain")}) == 1, first_losses


def test_bench_cross_entropy_times_every_variant_with_one_loss():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-W", "ignore", str(ROOT / "bench" / "bench_cross_entropy.py"), "--device", "cpu",
           "--shapes", "64x16", "--vocab", "100", "--repeat", "1", "--chunks", "16"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 64x16 |")]
    assert [r[1].strip() for r in rows] == ["eager", "compile", "dsfunc", "dsfunc, chunks of 16"], proc.stdout
    assert len({r[4].strip() for r in rows}) == 1 and all(float(r[2]) > 0 for r in rows), proc.stdout


def test_bench_muon_times_per_matrix_against_stacked_calls_with_one_result():
    """On the CPU, eager: the stacked calls give every matrix's update bit for bit (a difference of 0)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-W", "ignore", str(ROOT / "bench" / "bench_muon.py"), "--device", "cpu", "--layers", "2",
           "--d", "32", "--repeat", "1", "--warmup", "1", "--rounds", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 1 |")]
    assert [(r[1].strip(), r[3].strip()) for r in rows] == [("per matrix", "8"), ("stacked", "4"),
                                                           ("stacked, no cap", "4")], proc.stdout
    assert all(float(r[2]) > 0 and float(r[5]) == 0 for r in rows), proc.stdout


def test_bench_host_adam_times_every_variant_in_both_16_bit_dtypes():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-W", "ignore", str(ROOT / "bench" / "bench_host_adam.py"), "--numel", "100003",
           "--threads", "1,2", "--repeat", "1", "--chunk", "4096"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith(("| bfloat16", "| float16"))]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        (dtype, threads) for dtype in ("bfloat16", "float16") for threads in ("1", "2") for _ in range(3)]
    assert all(float(r[3]) > 0 for r in rows), proc.stdout


def test_profile_step_says_where_the_eager_step_time_goes():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-W", "ignore", str(ROOT / "bench" / "profile_step.py"), "--device", "cpu",
           "--steps", "5", "--top", "3"]
    proc = subprocess.run(cmd, cwd=ROOT / "bench", env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.endswith("ms/step")]
    parts = {line.rsplit(None, 2)[0].strip(): float(line.split()[-2]) for line in lines[:-1]}
    assert list(parts) == ["forward (binding, the model)", "backward (autograd, gradient hooks)",
                           "update (norm, optimizer, scaler, metrics)", "whole step"], proc.stdout
    assert all(v > 0 for v in parts.values()) and parts["whole step"] > parts["update (norm, optimizer, scaler, metrics)"]
    backward, whole = (float(x) for x in re.findall(r"([0-9.]+) ms/step", lines[-1]))
    assert lines[-1].startswith("  plain loop: backward") and 0 < backward < whole, lines[-1]


def test_bench_ep_counts_autoep_against_plain_zero3():
    """A tiny HF Qwen3-MoE under plain ZeRO-3 and under AutoEP at ep 2 with ZeRO-3: one model, the same first loss."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "bench" / "bench_ep.py"), "--model", "qwen3moe-tiny", "--shapes",
           "dp2:3,ep2:3", "--seq", "32", "--warmup", "0", "--steps", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| qwen3moe-tiny |")]
    assert [(r[2].strip(), r[3].strip(), r[5].strip() == "—") for r in rows] == [("dp2", "3", True),
                                                                               ("ep2", "3", False)], proc.stdout
    assert 0 < float(rows[1][5]) < float(rows[1][4])  # the experts are part of the rank's master bytes
    assert len({r[-1].split("->")[0].strip() for r in rows}) == 1, proc.stdout  # AutoEP computes the HF model


def _long_sequence_rows(*args: str) -> list[list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-W", "ignore", str(ROOT / "bench" / "bench_long_sequence.py"), "--device", "cpu", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines() if line.startswith("| ")]


def test_bench_long_sequence_trains_a_step_of_both_hf_systems():
    """One step of a tiny HF Llama under plain DeepSpeed ZeRO-3 offload and under dsfunc (tiled, offloaded)."""
    probes = _long_sequence_rows("--model", "llama-tiny", "--systems", "hf+deepspeed,hf+dsfunc", "--seqs", "96",
                                 "--limit", "300")
    steps = [r for r in probes if r[2] == "96"]
    assert [(r[1], r[3]) for r in steps] == [("hf+deepspeed", "trains"), ("hf+dsfunc", "trains")], probes
    assert all(float(r[4]) > 0 and float(r[7]) > 0 for r in steps), probes  # seconds, host peak


def test_bench_long_sequence_stops_a_slow_probe_and_counts_bytes():
    """A probe past its time limit is slower, not out of memory; the counted bytes of Llama-8B at 512K tokens."""
    slow = _long_sequence_rows("--model", "llama-tiny", "--systems", "hf+dsfunc", "--seqs", "96", "--limit", "0.5")
    assert [r[3] for r in slow if r[2] == "96"] == ["slower than the limit"], slow
    counted = _long_sequence_rows("--model", "llama-8b", "--estimate", "524288")
    at_512k = [r for r in counted if r[0] == "524,288"]
    assert len(at_512k) == 2 and all(r[7] == "128.0" for r in at_512k), counted  # 32 x 512K x 4096 x 2 B
    assert at_512k[0][9].startswith("no:"), counted  # fp32 master and Adam states beside them overflow 128 GiB


def test_bench_offload_samples_every_thread_s_stack_while_they_run(tmp_path):
    """The sampler of bench_offload's ``--stacks``: samples of the other threads' stacks, the worker's included,
    from a thread that holds the interpreter's lock (faulthandler's dumps, which do not, crashed processes)."""
    import importlib.util
    import threading

    spec = importlib.util.spec_from_file_location("bench_offload", ROOT / "bench" / "bench_offload.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stop = threading.Event()

    def busy_worker() -> None:
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=busy_worker)
    worker.start()
    try:
        with bench.sampled_stacks(tmp_path / "stacks.txt", every=0.01):
            stop.wait(0.3)
    finally:
        stop.set()
        worker.join()
    text = (tmp_path / "stacks.txt").read_text()
    assert text.count("---") >= 3 and "in busy_worker" in text, text[:2000]
