"""Reading a crafted checkpoint in a child process with a limited address space.

A reader that allocates beyond its bounds fails there with a MemoryError (not in pytest), one that crashes
(a C stack overflow) exits with a signal, and one that hangs runs into the parent's generous timeout: each
fails the test that called :func:`read_limited`. The outcome is the child's last line of output.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADROOM = 2 << 30  # bytes of address space the reader may take beyond the child's size before it


def read_limited(reader: str, *args: str, timeout: float = 600) -> str:
    """``READERS[reader](*args)`` in a child limited to its size plus :data:`HEADROOM`: ``loaded RESULT``
    or ``ErrorClass: message``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "tests.checkpoint.bounded", reader, *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout, check=False)
    assert run.returncode == 0, f"the reader died (exit {run.returncode}): {run.stderr[-3000:]}"
    return run.stdout.strip().splitlines()[-1]


def _load(run: str) -> str:
    import dsfunc
    from tests.models import MLP, config

    _, client = dsfunc.load_checkpoint(run, dsfunc.init_state(MLP(), config()))
    return repr(client)[:200]


def _export(run: str, out: str) -> str:
    from dsfunc import checkpoint

    return checkpoint.export_fp32(run, out)


def _load_deepspeed(save_dir: str, key: str) -> str:
    """Load a fixture case (named like ``s1_w1_fp32``) and describe the client value ``key``: how deep it
    nests along its first items, and whether its two items are one object (sharing kept)."""
    import dsfunc
    from tests.checkpoint.deepspeed.common import Case, Net

    name = Path(save_dir).name
    case = Case(int(name[1]), int(name[4]), name[6:10])
    _, client = dsfunc.load_checkpoint(save_dir, dsfunc.init_state(Net(), case.config(world=1, stage=0)))
    value, depth = client[key], 0
    while value:
        shared = value[0] is value[-1]
        value, depth = value[0], depth + 1
    return f"depth {depth} shared {shared}"


READERS = {"load": _load, "export": _export, "load_deepspeed": _load_deepspeed}


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))


if __name__ == "__main__":
    import torch  # noqa: F401 - its address space is the baseline, not the reader's

    import dsfunc  # noqa: F401

    limit = _vm_size() + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    reader, *arguments = sys.argv[1:]
    try:
        print(f"loaded {READERS[reader](*arguments)}")
    except Exception as e:  # noqa: BLE001 - the outcome is what the test compares
        print(f"{type(e).__name__}: {e}".replace("\n", " "))
