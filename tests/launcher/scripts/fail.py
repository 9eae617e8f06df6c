"""Launched by the launcher tests: rank 1 raises while the other ranks wait in a collective (or sleep)."""

import sys
import time

import torch
import torch.distributed as dist

from dsfunc.distributed import init_distributed

init_distributed()
if dist.get_rank() == 1:
    time.sleep(0.5)
    raise RuntimeError("boom from rank 1")
if "--sleep" in sys.argv:
    time.sleep(300)
dist.all_reduce(torch.ones(1))
time.sleep(300)
