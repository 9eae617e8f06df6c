"""Launched by the launcher tests: rank 1 never reaches the all-reduce the others wait in, or (``--mismatch``)
waits in a barrier the others never reach."""

import sys
import time

import torch
import torch.distributed as dist

from dsfunc.distributed import init_distributed

init_distributed()
if dist.get_rank() == 1:
    if "--mismatch" in sys.argv:
        dist.barrier()
    time.sleep(3000)
dist.all_reduce(torch.ones(1))
