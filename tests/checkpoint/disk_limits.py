"""Saves that hit a real file-size limit or a real read-only file system, by 2 gloo ranks, after a first
save that fit: what each rank raised, and what is left of the first checkpoint.

The read-only case runs as ``unshare --mount --map-root-user python -m tests.checkpoint.disk_limits MOUNT``:
it mounts a tmpfs at MOUNT in its own mount namespace (gone with the process), saves ``small``, remounts
it read-only and saves ``big``, printing the outcome as JSON.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.checkpoint.disk_full import WIDTH
from tests.models import MLP, config
from tests.multiprocess import run_world


def _state() -> dsfunc.TrainState:
    torch.manual_seed(0)
    return dsfunc.init_state(MLP(width=WIDTH), config(micro=2, world=2, stage=2))


def _try_save(state: dsfunc.TrainState, root: str) -> str:
    try:
        ckpt.save_checkpoint(state, root, tag="big", timeout=60)
        return "saved"
    except ckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"


def save_under_size_limit(rank: int, world: int, root: str, limit: int) -> dict[str, Any]:
    """Save ``small``; then, with writes past ``limit`` bytes refused (EFBIG, SIGXFSZ ignored), ``big``."""
    state = _state()
    ckpt.save_checkpoint(state, root, tag="small", timeout=60)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    error = _try_save(state, root)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return {"error": error, **_left(root)}


def save_small(rank: int, world: int, root: str) -> None:
    ckpt.save_checkpoint(_state(), root, tag="small", timeout=60)


def save_big(rank: int, world: int, root: str) -> dict[str, Any]:
    state = _state()
    return {"error": _try_save(state, root), **_left(root)}


def _left(root: str) -> dict[str, Any]:
    """What ``root`` holds after the failed save."""
    return {"left": sorted(os.listdir(root)), "latest": (Path(root) / "latest").read_text()}


def loads(root: str) -> bool:
    """Whether ``small`` loads (in this one process, at world size 1) and holds the weights it was saved with."""
    torch.manual_seed(0)
    expected = dsfunc.full_params(dsfunc.init_state(MLP(width=WIDTH), config(micro=4)))
    state, _ = ckpt.load_checkpoint(root, dsfunc.init_state(MLP(width=WIDTH), config(micro=4)), tag="small")
    got = dsfunc.full_params(state)
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def main() -> None:
    mount = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", mount], check=True)
    run_world(save_small, 2, mount)
    subprocess.run(["mount", "-o", "remount,ro", mount], check=True)
    errors = run_world(save_big, 2, mount)
    print(json.dumps({"ranks": errors, "loads": loads(mount)}))


if __name__ == "__main__":
    main()
