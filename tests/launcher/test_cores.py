"""Threads on a busy host: the cores other processes keep working are not shared out, and a process no launcher
started (``python train.py``) runs torch on the cores left free unless OMP_NUM_THREADS says otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

from dsfunc.launcher.cores import busy_cores, threads_per_rank
from tests.launcher.scripts.harness import REPO

CORES = len(os.sched_getaffinity(0))


def test_busy_cores_are_not_shared_out():
    assert threads_per_rank(1, False, None) == CORES
    assert threads_per_rank(1, False, None, busy=CORES + 5.0) == 1  # at least one
    assert threads_per_rank(1, False, None, busy=CORES - 1.0) == 1
    assert threads_per_rank(2, False, None, busy=0.0) == max(1, CORES // 2)
    assert busy_cores() >= 0.0


def _threads_after_init_state(**env: str) -> subprocess.CompletedProcess:
    code = ("import torch, dsfunc\n"
            "torch.set_num_threads(64)\n"  # more threads than cores: at least the cores' count is too many
            "dsfunc.init_state(torch.nn.Linear(2, 2), {'train_micro_batch_size_per_gpu': 1, "
            "'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}})\n"
            "print('threads', torch.get_num_threads())\n")
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "WORLD_SIZE", "RANK")}
    full.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=300, check=True)


def test_init_state_fits_torch_threads_to_the_free_cores_in_one_line():
    proc = _threads_after_init_state()
    threads = int(proc.stdout.split("threads ")[1])
    assert 1 <= threads <= CORES
    lines = [line for line in proc.stderr.splitlines() if "set OMP_NUM_THREADS to choose" in line]
    assert len(lines) == 1 and f"torch runs on {threads} thread(s) instead of 64" in lines[0], proc.stderr


def test_omp_num_threads_is_the_users_choice():
    proc = _threads_after_init_state(OMP_NUM_THREADS="3")
    assert "threads 64" in proc.stdout and "OMP_NUM_THREADS" not in proc.stderr
