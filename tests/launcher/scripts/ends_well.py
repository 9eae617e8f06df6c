"""Launched by the launcher tests: a program that ends well leaving what the interpreter's exit finishes: a
process group and a subgroup still referenced (gloo's threads alive), a file written but never closed or flushed,
a non-daemon thread still working, an ``atexit`` handler, and stdout with no final newline."""

import atexit
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from dsfunc.distributed import init_distributed

init_distributed()
groups = [dist.group.WORLD, dist.new_group(backend="gloo")]
dist.all_reduce(torch.ones(1), group=groups[1])
rank = dist.get_rank()
out = sys.argv[-1]
unflushed = open(os.path.join(out, f"unflushed.{rank}"), "w")  # noqa: SIM115 - left open on purpose
unflushed.write("written, never flushed")


def late_worker():
    time.sleep(1)
    with open(os.path.join(out, f"thread.{rank}"), "w") as f:
        f.write("joined")


threading.Thread(target=late_worker).start()
atexit.register(lambda: open(os.path.join(out, f"atexit.{rank}"), "w").close())
sys.stdout.write(f"rank {rank} ends without a newline")
