"""The rank variables a launcher leaves (dsfunc.distributed.env): Open MPI's and slurm's names, the MPI
markers."""

from __future__ import annotations

import pytest

from dsfunc.distributed.env import MPI_MARKERS, launched_by_mpi, rank_env_from_launcher, rank_variable
from dsfunc.errors import UsageError


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RANK": "3"}, {}),
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
        ),
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "7",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "3",
                "SLURM_TASKS_PER_NODE": "2(x3),1",
            },
            {"RANK": "5", "WORLD_SIZE": "7", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
        ),
    ],
)
def test_shim_rank_variables(env, expected):
    assert rank_env_from_launcher(env) == expected


def test_shim_refuses_unknown_launcher():
    with pytest.raises(RuntimeError, match="start it through the dsfunc launcher"):
        rank_env_from_launcher({})


def test_bad_slurm_tasks_per_node_is_a_usage_error():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2x"}
    with pytest.raises(UsageError, match=r"cannot parse SLURM_TASKS_PER_NODE='2x'"):
        rank_env_from_launcher(env)


@pytest.mark.parametrize("marker", MPI_MARKERS)
def test_launched_by_mpi(marker):
    assert launched_by_mpi({marker: "2"}) and not launched_by_mpi({"RANK": "0", "WORLD_SIZE": "2"})


def test_rank_variable_prefers_torch_names_then_open_mpi():
    both = {"RANK": "3", "OMPI_COMM_WORLD_RANK": "1"}
    assert rank_variable("RANK", 0, both) == 3
    assert rank_variable("RANK", 0, {"OMPI_COMM_WORLD_RANK": "1"}) == 1
    assert rank_variable("WORLD_SIZE", 1, {"OMPI_COMM_WORLD_SIZE": "4"}) == 4
    assert rank_variable("LOCAL_RANK", 0, {}) == 0 and rank_variable("WORLD_SIZE", 1, {}) == 1
