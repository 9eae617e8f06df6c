"""Launched by the launcher tests: rank 1 exits with code 3 and no traceback (``sys.exit``, or ``os._exit``
with ``--os-exit``) while rank 0 waits for it in a collective."""

import os
import sys
import time

import torch
import torch.distributed as dist

from dsfunc.distributed import init_distributed

init_distributed()
if dist.get_rank() == 1:
    time.sleep(0.5)
    if "--os-exit" in sys.argv:
        os._exit(3)
    sys.exit(3)
dist.all_reduce(torch.ones(1))
time.sleep(300)
