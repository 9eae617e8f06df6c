"""The collectives (dsfunc.distributed.comm): the identity in a lone process, sums and rank-order gathers in a
group."""

from __future__ import annotations

import torch

from dsfunc.distributed import comm
from tests.multiprocess import run_world


def test_lone_process_collectives_are_the_identity():
    assert not comm.is_distributed() and (comm.rank(), comm.world_size()) == (0, 1)
    world = comm.Group.world()
    assert (world.ranks, world.rank, world.size) == ((0,), 0, 1)
    t = torch.tensor([1.0, 2.0])
    assert isinstance(comm.all_reduce_sum(t, world, async_op=True), comm.Done) and t.tolist() == [1.0, 2.0]
    out = torch.zeros(2)
    assert comm.reduce_scatter_sum(out, torch.tensor([3.0, 4.0]), world).wait()
    assert out.tolist() == [3.0, 4.0]
    comm.all_gather_flat(out, torch.tensor([5.0, 6.0]), world)
    assert out.tolist() == [5.0, 6.0]
    comm.all_gather_flat(out, out, world)  # gathering a buffer into itself is a no-op
    assert out.tolist() == [5.0, 6.0]
    comm.broadcast(out, world)
    assert out.tolist() == [5.0, 6.0]


def _collectives(rank, world_size):
    world = comm.Group.world()
    total = torch.full((4,), float(rank + 1))
    comm.all_reduce_sum(total, world)
    shard = torch.zeros(2)
    comm.reduce_scatter_sum(shard, torch.arange(4.0) + rank, world, async_op=True).wait()
    full = torch.zeros(4)
    comm.all_gather_flat(full, torch.full((2,), float(rank)), world).wait()
    flags = torch.tensor([rank == 0, rank == 1])
    strided = torch.full((2, 3), float(rank)).t()  # not contiguous
    comm.broadcast(flags, world)
    comm.broadcast(strided, world, src=1)
    return (comm.is_distributed(), comm.rank(), comm.world_size(), total.tolist(), shard.tolist(), full.tolist(),
            flags.tolist(), strided.sum().item())


def test_collectives_over_two_ranks():
    assert run_world(_collectives, 2) == [
        (True, 0, 2, [3.0] * 4, [1.0, 3.0], [0.0, 0.0, 1.0, 1.0], [True, False], 6.0),
        (True, 1, 2, [3.0] * 4, [5.0, 7.0], [0.0, 0.0, 1.0, 1.0], [True, False], 6.0),
    ]
