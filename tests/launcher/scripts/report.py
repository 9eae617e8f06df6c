"""Launched by the launcher tests: joins the group, all-reduces, and writes what this rank saw to OUTDIR."""

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dsfunc.distributed import get_local_rank, init_distributed

out_dir = sys.argv[-1]
init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
total = torch.tensor([float(rank + 1)], device=device)
dist.all_reduce(total)
report = {
    "rank": rank,
    "world_size": world,
    "local_rank": get_local_rank(),
    "sum": total.item(),
    "argv": sys.argv[1:],
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "device": device,
    "backend": dist.get_backend(),
    "torch": torch.__version__,
    "cpus": sorted(os.sched_getaffinity(0)),
    "cpus_allowed_list": next(line.split(":", 1)[1].strip() for line in Path("/proc/self/status").read_text().splitlines()
                              if line.startswith("Cpus_allowed_list:")),
    "threads": torch.get_num_threads(),
    "env": {
        k: v
        for k, v in os.environ.items()
        if k
        in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES",
            "PYTHONPATH",
            "OMP_NUM_THREADS",
            "CROSS_RANK",
        )
        or k.startswith(("DSFUNC_TEST", "NCCL", "UCX"))
    },
}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
