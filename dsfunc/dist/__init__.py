"""Processes and collectives: joining the process group (:mod:`~dsfunc.dist.init`) and every collective
dsfunc issues (:mod:`~dsfunc.dist.comm`)."""

from dsfunc.dist.init import get_local_rank, get_rank, get_world_size, init_distributed

__all__ = ["get_local_rank", "get_rank", "get_world_size", "init_distributed"]
