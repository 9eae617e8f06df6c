"""Run a function on N real processes joined in a process group (gloo, or NCCL on GPUs): the multi-process test harness."""

from __future__ import annotations

import argparse
import io
import os
import random
import socket
import traceback
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.multiprocessing as mp


def _ports() -> Iterator[int]:
    """This pytest worker's own stretch of ports below the kernel's ephemeral range, walked from a random start.

    A port the kernel hands out for ``bind(0)`` is ephemeral: between closing it and the rendezvous binding it, gloo's
    own outgoing connections (which draw from that range) or a test on the other worker can take it. Ports below
    the range are never drawn by the kernel, and each xdist worker has its own slice of them.
    """
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    width = (ephemeral_low - 10000) // workers
    low = 10000 + worker * width
    port = low + random.randrange(width)
    while True:
        port = low + (port - low + 1) % width
        yield port


_PORTS = _ports()


def free_port() -> int:
    """A port nothing listens on now, and that no other caller in this test run is handed soon after."""
    while True:
        port = next(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def backend(parser: argparse.ArgumentParser | None = None) -> tuple[ModuleType, argparse.Namespace]:
    """For a torchrun script run under real DeepSpeed and under dsfunc: ``--backend``, ``--out`` and ``--local_rank``
    added to ``parser`` (the script's own arguments) and parsed; the backend imported, its gloo group started."""
    import importlib

    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["deepspeed", "dsfunc"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    module = importlib.import_module(args.backend)
    module.init_distributed(dist_backend="gloo")
    return module, args


def leave_together() -> None:
    """End a torchrun script's ranks together, as the dsfunc launcher ends a rank whose program ended well: every
    rank done before any leaves, the process group ended, then the process ended without the interpreter's
    finalization (see [Note: ending without finalization] in dsfunc.launcher.shim)."""
    import torch.distributed as dist

    from dsfunc.launcher.shim import end_process

    dist.barrier()
    dist.destroy_process_group()
    end_process()


# imported once by the forkserver that every gloo rank forks from, instead of by each rank (~2.4 s of CPU a rank
# on this 2-core machine, most of the cost of a small multi-process test)
PRELOAD = ["torch", "torch.distributed", "optree", "dsfunc", "tests.models", "tests.multiprocess"]


def _context(backend: str):
    """forkserver with torch and dsfunc preloaded; spawn for NCCL (nothing may touch CUDA before a fork)."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(fn, rank, world_size, port, args, queue, backend, environ, cwd):
    # a forked rank starts with the forkserver's environment and directory: take the caller's, as a spawned one would
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)  # plain bytes: tensors in shared memory would die with this process
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - any failure is reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240,
              backend: str = "gloo") -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (module level). A failure on any rank raises with that rank's traceback.
    """
    ctx = _context(backend)
    queue = ctx.Queue()
    port = free_port()
    environ, cwd = dict(os.environ), os.getcwd()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, queue, backend, environ, cwd))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
