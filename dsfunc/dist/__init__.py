"""Processes and collectives: joining the process group (:mod:`~dsfunc.dist.init`), the rank variables a
launcher left (:mod:`~dsfunc.dist.env`) and every collective dsfunc issues (:mod:`~dsfunc.dist.comm`)."""

from dsfunc.dist.env import launched_by_mpi
from dsfunc.dist.init import get_local_rank, get_rank, get_world_size, init_distributed

__all__ = ["get_local_rank", "get_rank", "get_world_size", "init_distributed", "launched_by_mpi"]
