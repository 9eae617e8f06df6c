"""init_distributed and the rank helpers (MPI discovery runs under real mpirun in tests/launcher/test_mpi.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

from dsfunc.distributed import get_local_rank, get_rank, get_world_size, init_distributed
from dsfunc.errors import InputError, UsageError
from tests.launcher.scripts.harness import REPO, cli_env, free_port
from tests.multiprocess import run_world

RANK_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
MPI_VARS = (
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "MV2_COMM_WORLD_SIZE",
    "MPI_LOCALNRANKS",
)


@pytest.fixture
def bare_env(monkeypatch):
    """No rank variables and no MPI launcher variables."""
    for key in RANK_VARS + MPI_VARS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def _python(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    full_env = cli_env(tmp_path)
    for key in MPI_VARS:
        full_env.pop(key, None)
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_helpers_without_a_group(bare_env):
    assert (get_rank(), get_world_size(), get_local_rank()) == (0, 1, 0)
    bare_env.setenv("RANK", "5")
    bare_env.setenv("WORLD_SIZE", "8")
    bare_env.setenv("LOCAL_RANK", "1")
    assert (get_rank(), get_world_size(), get_local_rank()) == (5, 8, 1)


def test_missing_environment_names_the_variables(bare_env):
    bare_env.setenv("RANK", "0")
    with pytest.raises(RuntimeError) as info:
        init_distributed()
    message = str(info.value)
    assert "WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK not set" in message
    assert "dsfunc --num_gpus N script.py" in message and "mpirun" in message
    assert not dist.is_initialized()


def test_dist_init_required_false_without_a_group_is_an_error(bare_env):
    """False says the script initialises torch.distributed itself; DeepSpeed asserts the group exists."""
    with pytest.raises(UsageError, match="dist_init_required=False: torch.distributed is not initialized"):
        init_distributed(dist_init_required=False, config={"comms_logger": {"enabled": False}})
    assert not dist.is_initialized()


def _init_not_required(rank, world_size):
    init_distributed(dist_init_required=False)  # the harness's group: used as it is
    return dist.get_world_size()


def test_dist_init_required_false_uses_the_scripts_group():
    assert run_world(_init_not_required, 2) == [2, 2]


def test_init_method_needs_rank_and_world_size(bare_env):
    with pytest.raises(
        ValueError, match=r"init_method='tcp://127.0.0.1:1'\) also needs rank= and world_size="
    ):
        init_distributed(init_method="tcp://127.0.0.1:1", rank=0)


def test_init_errors_are_dsfunc_errors(bare_env):
    with pytest.raises(InputError):
        init_distributed(init_method="tcp://127.0.0.1:1", rank=0)
    with pytest.raises(UsageError):
        init_distributed()


def _check_group(rank, world_size):
    init_distributed()  # already initialised by the harness: must be a no-op
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    return get_rank(), get_world_size(), get_local_rank()


def test_noop_when_initialised_and_helpers_follow_the_group():
    assert run_world(_check_group, 2) == [(0, 2, 0), (1, 2, 1)]


def test_env_init_and_explicit_init_method(tmp_path):
    port = free_port()
    code = (
        "import torch.distributed as dist\n"
        "from dsfunc.distributed import init_distributed\n"
        "init_distributed()\n"
        "print(dist.get_backend(), dist.get_rank(), dist.get_world_size())\n"
        "dist.destroy_process_group()\n"
        f"init_distributed(init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "print(dist.get_world_size())\n"
        "dist.destroy_process_group()\n"
    )
    res = _python(
        code,
        tmp_path,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["gloo", "0", "1", "1"]


def test_mpi_launcher_without_mpi4py_is_a_clear_error(tmp_path):
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"  # as if mpi4py were not installed
        "from dsfunc.distributed import init_distributed\ninit_distributed()\n"
    )
    res = _python(code, tmp_path, PMI_SIZE="2")
    assert res.returncode != 0
    assert "started by an MPI launcher, but mpi4py is not installed" in res.stderr
