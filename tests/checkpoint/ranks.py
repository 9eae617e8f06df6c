"""Ranks that may die: like ``tests.multiprocess.run_world``, but a rank's exit code and traceback are
results, not failures (the fault tests kill ranks on purpose)."""

from __future__ import annotations

import io
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.multiprocess import free_port


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, backend: str, args: tuple,
           queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world)
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args), buffer)
        queue.put((rank, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, traceback.format_exc().encode()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120,
              backend: str = "gloo") -> list[tuple[int, Any]]:
    """Like ``run_world``, but ranks may die: ``(exit code, fn's result or traceback)`` for each rank.
    With ``backend="nccl"`` rank r uses GPU r."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, backend, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            raise AssertionError(f"rank {procs.index(p)} did not finish within {timeout} s")
    replies = {}
    while not queue.empty():
        rank, value = queue.get()
        failed = value.startswith(b"Traceback")
        replies[rank] = value.decode() if failed else torch.load(io.BytesIO(value), weights_only=False)
    return [(p.exitcode, replies.get(r)) for r, p in enumerate(procs)]
