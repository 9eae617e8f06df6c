"""The run's mesh (dsfunc.distributed.mesh): axes from the config, torch's DeviceMesh, each rank's groups, ZeRO's
dp x sp group, and the errors for what it cannot be."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dsfunc
from dsfunc.distributed import comm
from dsfunc.distributed.mesh import from_device_mesh, make_mesh
from tests.multiprocess import run_world


def test_one_process_mesh_is_all_dp_with_lone_groups():
    mesh = make_mesh()
    assert mesh.describe() == "pp 1 x dp 1 x sp 1 x tp 1" and mesh.device_mesh is None
    assert mesh.zero.ranks == (0,) and mesh.group("tp").size == 1 and mesh.batch_ranks == 1
    with pytest.raises(dsfunc.NotSupportedError, match="ep axis"):
        mesh.group("ep")
    with pytest.raises(dsfunc.InputError, match="no mesh axis 'xp'"):
        mesh.size("xp")
    with pytest.raises(dsfunc.InputError, match="no torch DeviceMesh dimension 'sp'"):
        mesh["sp"]
    with pytest.raises(dsfunc.InputError, match="world size 1 is not divisible by the mesh's tp 1 x sp 2 x pp 1"):
        make_mesh(sp=2)


def _groups(rank, world_size):
    mesh = make_mesh(tp=2)  # dp 2 x tp 2
    given = from_device_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp")))
    ulysses = given["sp"].get_group()  # what the sequence-parallel attention talks over
    other = make_mesh(tp=4)
    with pytest.raises(dsfunc.InputError, match="is not the state's"):
        mesh.check_same(other)
    mesh.check_same(mesh.device_mesh)
    total = torch.ones(1)
    comm.all_reduce_sum(total, mesh.zero)
    return (mesh.sizes, mesh.zero.ranks, mesh.group("tp").ranks, given.zero.ranks, given.group("sp").ranks,
            comm.Group.of(ulysses).ranks, total.item())


def test_dp_tp_and_dp_sp_groups_on_four_ranks():
    out = run_world(_groups, 4, timeout=600)
    assert out[0][0] == {"pp": 1, "dp": 2, "sp": 1, "tp": 2}
    # tp innermost: a tp group's ranks are neighbours, ZeRO's (dp) every other rank; dp x sp is all four
    assert [o[1:6] for o in out] == [
        ((0, 2), (0, 1), (0, 1, 2, 3), (0, 1), (0, 1)),
        ((1, 3), (0, 1), (0, 1, 2, 3), (0, 1), (0, 1)),
        ((0, 2), (2, 3), (0, 1, 2, 3), (2, 3), (2, 3)),
        ((1, 3), (2, 3), (0, 1, 2, 3), (2, 3), (2, 3)),
    ]
    assert all(o[6] == 2.0 for o in out)
