"""Launched by the launcher tests: after an all-reduce, rank 0's program ends (its interpreter then waits
for a thread) and rank 1 is killed with SIGKILL a moment later."""

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from dsfunc.distributed import init_distributed

init_distributed()
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 1:
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
threading.Thread(target=time.sleep, args=(300,)).start()
