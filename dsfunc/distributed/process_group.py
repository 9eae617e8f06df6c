"""Joining the process group: ``init_distributed`` (DeepSpeed's semantics) and rank helpers.

The rank variables come from the environment (set by the dsfunc launcher or torchrun); when they are missing
and the process was started by an MPI launcher, they are discovered through mpi4py (or read from Open MPI's
``OMPI_COMM_WORLD_*`` variables by :mod:`dsfunc.distributed.env` when mpi4py is not installed).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import subprocess

import torch
import torch.distributed as dist

from dsfunc.distributed import comm
from dsfunc.distributed.env import launched_by_mpi, ompi_rank_env, rank_variable
from dsfunc.errors import InputError, UsageError

logger = logging.getLogger("dsfunc")

REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")

_HOW_TO_LAUNCH = (
    "Start the script with the dsfunc launcher (`dsfunc --num_gpus N script.py`), torchrun, or mpirun "
    "(MPI discovery needs mpi4py), or pass init_method=, rank= and world_size="
)


def _first_address() -> str:
    """This host's first address (``hostname -I``), falling back to the address its name resolves to."""
    try:
        out = subprocess.run(
            ["hostname", "-I"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return socket.gethostbyname(socket.gethostname())


def mpi_discovery(distributed_port: int = 29500) -> dict[str, str]:
    """Rank variables from mpi4py's COMM_WORLD: rank and size, local rank/size from processor names, and rank
    0's address (127.0.0.1 when every rank shares rank 0's host). Existing MASTER_ADDR/MASTER_PORT are
    kept."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    names = world.allgather(MPI.Get_processor_name())
    same_host = all(n == names[0] for n in names)
    master_addr = world.bcast(None if rank != 0 else ("127.0.0.1" if same_host else _first_address()), root=0)
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(sum(1 for n in names[:rank] if n == names[rank])),
        "LOCAL_WORLD_SIZE": str(names.count(names[rank])),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", master_addr),
        "MASTER_PORT": os.environ.get("MASTER_PORT", str(distributed_port)),
    }
    world.Barrier()
    return env


def _ompi_env(distributed_port: int) -> dict[str, str]:
    """Rank variables from Open MPI's ``OMPI_COMM_WORLD_*`` (used when mpi4py is not installed)."""
    env = {**ompi_rank_env(os.environ), "MASTER_PORT": os.environ.get("MASTER_PORT", str(distributed_port))}
    if "MASTER_ADDR" in os.environ:
        env["MASTER_ADDR"] = os.environ["MASTER_ADDR"]
    elif env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"]:
        env["MASTER_ADDR"] = "127.0.0.1"
    return env


def _discover(distributed_port: int, verbose: bool) -> None:
    """Fill in missing rank variables from the MPI launcher that started this process, if any."""
    if not launched_by_mpi():
        return
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        if "OMPI_COMM_WORLD_RANK" not in os.environ:
            raise UsageError(
                "init_distributed: started by an MPI launcher, but mpi4py is not installed and the rank "
                "variables are missing; `pip install mpi4py` (or dsfunc[mpi])"
            ) from None
        found = _ompi_env(distributed_port)
        source = "OMPI_COMM_WORLD_* variables"
    else:
        found = mpi_discovery(distributed_port)
        source = "MPI discovery (mpi4py)"
    for key, value in found.items():
        os.environ.setdefault(key, value)
    if verbose:
        logger.info(
            "%s: rank %s of %s, local rank %s, master %s:%s",
            source,
            os.environ["RANK"],
            os.environ["WORLD_SIZE"],
            os.environ["LOCAL_RANK"],
            os.environ.get("MASTER_ADDR"),
            os.environ["MASTER_PORT"],
        )


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise ``torch.distributed`` the way ``deepspeed.init_distributed`` does (no-op if already done).

    Args:
        dist_backend: process-group backend; default ``nccl`` when CUDA is available, ``gloo`` otherwise.
        auto_mpi_discovery: when RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK are missing and an MPI
            launcher started the process, discover them (mpi4py, or ``OMPI_COMM_WORLD_*``).
        distributed_port: MASTER_PORT used by MPI discovery when none is set.
        verbose: log how the group was formed (logger ``dsfunc``, INFO).
        timeout: collective timeout; default ``DEEPSPEED_TIMEOUT`` minutes if set, else torch's default.
        init_method: a torch init method (``tcp://...``, ``file://...``); default ``env://``.
        dist_init_required: False says the script initialises torch.distributed itself: nothing is joined,
            and a missing process group is an error (as DeepSpeed's assertion).
        config: DeepSpeed's comms-logger config; accepted, dsfunc has no comms logger.
        rank, world_size: explicit values (>= 0) override the environment.

    Example::

        dsfunc.init_distributed()          # in a script started by `dsfunc`, torchrun or mpirun
    """
    if comm.is_distributed():
        return
    if dist_init_required is False:
        raise UsageError(
            "dist_init_required=False: torch.distributed is not initialized, and False says "
            "the script initialises it itself. Call torch.distributed.init_process_group(...) first, or pass "
            "dist_init_required=None (the default) to join the world the launcher describes"
        )
    explicit = init_method not in (None, "env://")
    missing = [k for k in REQUIRED_ENV if k not in os.environ]
    if missing and auto_mpi_discovery and not explicit:
        _discover(distributed_port, verbose)
        missing = [k for k in REQUIRED_ENV if k not in os.environ]
    if explicit:
        missing = [n for n, v in (("rank", rank), ("world_size", world_size)) if v < 0]
        if missing:
            raise InputError(
                f"init_distributed(init_method={init_method!r}) also needs rank= and world_size="
            )
    else:
        missing = [
            k for k in missing if not (k == "RANK" and rank >= 0 or k == "WORLD_SIZE" and world_size >= 0)
        ]
        if missing:
            raise UsageError(
                f"init_distributed: {', '.join(missing)} not set in the environment. {_HOW_TO_LAUNCH}."
            )
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if timeout is None and os.environ.get("DEEPSPEED_TIMEOUT"):
        timeout = datetime.timedelta(minutes=float(os.environ["DEEPSPEED_TIMEOUT"]))
    if torch.cuda.is_available() and backend != "gloo":
        torch.cuda.set_device(get_local_rank())
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size >= 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(backend, init_method=init_method or "env://", **kwargs)
    atexit.register(_destroy_at_exit)
    if verbose:
        logger.info("init_distributed: rank %d of %d, backend %s", comm.rank(), comm.world_size(), backend)


def described_world() -> int | None:
    """The number of processes the launcher's variables describe (``WORLD_SIZE``, else Open MPI's); None when
    no launcher set them."""
    if "WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ:
        return rank_variable("WORLD_SIZE", 1)
    return None


def check_one_world(world: int, what: str) -> None:
    """Refuse ``what`` in a world of ``world`` processes when the environment describes another: the ranks a
    launcher started would each train (and save) a model of their own."""
    described = described_world()
    if described is not None and described != world:
        raise UsageError(
            f"{what} runs in a world of {world} process(es), but the launcher's environment describes "
            f"{described} (WORLD_SIZE={described}): its ranks would train {described} unrelated models. Let "
            "dsfunc join the world (do not create a process group of your own of another size), or run the "
            "script without a launcher (unset WORLD_SIZE) to train on one process"
        )


def join_launched_world(distributed_port: int = 29500) -> None:
    """Join the process group the environment describes (started by dsfunc, torchrun or mpirun), unless one
    exists, and check that the group is that world (:func:`check_one_world`). A process no launcher started
    keeps no group (world size 1)."""
    if not comm.is_distributed() and ("WORLD_SIZE" in os.environ or launched_by_mpi()):
        init_distributed(distributed_port=distributed_port)
    check_one_world(dist.get_world_size() if comm.is_distributed() else 1, "the training state")


def join_world(distributed_port: int = 29500) -> None:
    """:func:`join_launched_world`, or form a one-process group for a process no launcher started
    (``python train.py``), as DeepSpeed's ``initialize`` and ``zero.Init`` do (through MPI discovery):
    libraries that call ``torch.distributed`` next to the engine (accelerate gathering metrics) find a
    group. A lone group's store lives in memory, so it takes no port."""
    join_launched_world(distributed_port)
    if comm.is_distributed():
        return
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    """Tear down the group we created, so a script that simply ends does not abort in gloo/NCCL teardown."""
    if comm.is_distributed():
        dist.destroy_process_group()


# The rank helpers also answer before the group exists (a script sizing its data loader before joining):
# the process group's answer (dsfunc.distributed.comm) once joined, until then the launcher's variables
# (dsfunc.distributed.env: torch's names, else Open MPI's), and a lone process's answer when neither is set.


def get_rank() -> int:
    """This process's global rank: the process group's if joined, else ``RANK`` (0 if unset)."""
    return comm.rank() if comm.is_distributed() else rank_variable("RANK", 0)


def get_world_size() -> int:
    """Number of processes: the process group's if joined, else ``WORLD_SIZE`` (1 if unset)."""
    return comm.world_size() if comm.is_distributed() else rank_variable("WORLD_SIZE", 1)


def get_local_rank() -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (a process group does not know it), 0 if unset."""
    return rank_variable("LOCAL_RANK", 0)
