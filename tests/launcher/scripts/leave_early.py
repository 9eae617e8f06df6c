"""Launched by the launcher tests: rank 1 exits with code 0 while rank 0 goes on to an all-reduce."""

import sys
import time

import torch
import torch.distributed as dist

from dsfunc.distributed import init_distributed

init_distributed()
if dist.get_rank() == 1:
    sys.exit(0)
time.sleep(0.5)
dist.all_reduce(torch.ones(1))
