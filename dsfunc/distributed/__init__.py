"""Processes and collectives: joining the process group (:mod:`~dsfunc.distributed.process_group`), the rank
variables a launcher left (:mod:`~dsfunc.distributed.env`) and every collective dsfunc issues
(:mod:`~dsfunc.distributed.comm`)."""

from dsfunc.distributed.env import launched_by_mpi
from dsfunc.distributed.process_group import get_local_rank, get_rank, get_world_size, init_distributed

__all__ = ["get_local_rank", "get_rank", "get_world_size", "init_distributed", "launched_by_mpi"]
