"""Rank variables from the environment a launcher left in a rank.

torchrun and the dsfunc launcher set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE; ``mpirun`` (Open
MPI) and ``srun`` (slurm) set their own names instead. The per-rank shim (:mod:`dsfunc.launcher.shim`) and
:func:`dsfunc.distributed.init_distributed` both translate them here, so they agree on what each launcher
means.
Plain functions of a mapping: no torch, no process group.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from dsfunc.errors import UsageError

#: Variables that MPI launchers (Open MPI, MPICH/Intel MPI/PMIx, MVAPICH) set in each rank.
MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")

# Open MPI's name for each torch rank variable.
_OMPI_NAMES = {
    "RANK": "OMPI_COMM_WORLD_RANK",
    "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
    "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
    "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE",
}


def launched_by_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher started this process (one of :data:`MPI_MARKERS` is set in ``environ``,
    default ``os.environ``), so that its rank variables can be discovered."""
    environ = os.environ if environ is None else environ
    return any(k in environ for k in MPI_MARKERS)


def ompi_rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE from Open MPI's ``OMPI_COMM_WORLD_*`` (all must be set)."""
    return {name: environ[ompi] for name, ompi in _OMPI_NAMES.items()}


def _slurm_local_size(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from ``SLURM_TASKS_PER_NODE`` syntax such as ``2(x3),1``."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            raise UsageError(f"cannot parse SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts[node_id]


def _slurm_rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The rank variables from srun's ``SLURM_*`` (a node's task count from ``SLURM_TASKS_PER_NODE`` when
    ``SLURM_NTASKS_PER_NODE`` is not set)."""
    local_size = environ.get("SLURM_NTASKS_PER_NODE") or str(
        _slurm_local_size(environ["SLURM_TASKS_PER_NODE"], int(environ.get("SLURM_NODEID", "0")))
    )
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ["SLURM_LOCALID"],
        "LOCAL_WORLD_SIZE": local_size,
    }


def rank_env_from_launcher(env: Mapping[str, str]) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE from MPI's or slurm's variables ({} if RANK is set)."""
    if "RANK" in env:
        return {}
    if "OMPI_COMM_WORLD_RANK" in env:
        return ompi_rank_env(env)
    if "SLURM_PROCID" in env:
        return _slurm_rank_env(env)
    raise UsageError(
        "dsfunc.launcher.shim: RANK is not set and neither mpirun (OMPI_COMM_WORLD_RANK) nor srun "
        "(SLURM_PROCID) started this process; start it through the dsfunc launcher"
    )


def rank_variable(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    """``name`` (RANK, WORLD_SIZE, LOCAL_RANK or LOCAL_WORLD_SIZE) as the launcher left it in ``environ``
    (default ``os.environ``): the torch variable, else Open MPI's, else ``default``."""
    environ = os.environ if environ is None else environ
    return int(environ.get(name, environ.get(_OMPI_NAMES[name], str(default))))
