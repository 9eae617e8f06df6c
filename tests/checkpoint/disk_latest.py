"""A save that finds the disk full exactly when it writes ``latest``, on a real (tmpfs) disk filled to the byte.

Run as ``unshare --mount --map-root-user python -m tests.checkpoint.disk_latest FOLDER``: in its own mount
namespace (gone with the process) it measures on one tmpfs how many bytes a second save adds, then on a
fresh tmpfs saves ``first``, fills the disk until exactly those bytes are free (``latest`` then has no room:
tmpfs gives each file whole pages) and saves ``second``. It prints, as JSON, what the save raised and what
was left, and whether ``second`` loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from dsfunc.checkpoint.disk import free_bytes
from tests.models import MLP, config


def _disk(path: Path) -> Path:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)], check=True)
    return path


def main() -> None:
    root = Path(sys.argv[1])
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), config())
    probe = _disk(root / "probe")
    ckpt.save_checkpoint(state, probe, tag="first")
    before = free_bytes(probe)
    ckpt.save_checkpoint(state, probe, tag="second")
    needed = before - free_bytes(probe)

    full = _disk(root / "full")
    ckpt.save_checkpoint(state, full, tag="first")
    (full / "filler").write_bytes(b"\0" * (free_bytes(full) - needed))
    try:
        ckpt.save_checkpoint(state, full, tag="second")
        error = "saved"
    except ckpt.CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    left = sorted(os.listdir(full))
    latest = (full / "latest").read_text()
    loaded, _ = ckpt.load_checkpoint(full, dsfunc.init_state(MLP(), config()), tag="second")
    (full / "filler").unlink()
    ckpt.save_checkpoint(state, full, tag="third")
    print(json.dumps({"error": error, "left": left, "latest": latest, "loads": int(loaded.step) == 0,
                      "after": sorted(os.listdir(full))}))


if __name__ == "__main__":
    main()
