"""A checkpoint saved onto a filesystem too small for it, by 2 gloo ranks, on a real (tmpfs) full disk.

Run as ``unshare --mount --map-root-user python -m tests.checkpoint.disk_full MOUNT SIZE``: it mounts a tmpfs
of SIZE at MOUNT inside its own mount namespace (gone with the process, so nothing is left mounted), saves,
and prints what each rank raised and what was left on the disk, as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.models import MLP, config
from tests.multiprocess import run_world

WIDTH = 256  # ~200k parameters: with Adam's moments each of 2 ranks writes ~1.2 MB at ZeRO stage 2


def save(rank: int, world: int, root: str) -> str:
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(width=WIDTH), config(micro=2, world=world, stage=2))
    try:
        ckpt.save_checkpoint(state, root, tag="big", timeout=60)
        return "saved"
    except ckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"


def main() -> None:
    mount, size = sys.argv[1:3]
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mount], check=True)
    errors = run_world(save, 2, mount)
    print(json.dumps({"errors": errors, "left": sorted(os.listdir(mount))}))


if __name__ == "__main__":
    main()
