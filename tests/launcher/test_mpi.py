"""MPI: `mpirun python script.py` forms a group through init_distributed's MPI discovery, and
`dsfunc --launcher openmpi` starts the ranks through mpirun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.scripts.harness import (
    SCRIPTS,
    STOPPED_WITHIN_S,
    cli_env,
    free_port,
    interrupt_and_wait,
    reports,
    run_dsfunc,
    run_dsfunc_here,
    start_dsfunc,
    wait_for_files,
    wait_gone,
)

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)",
)

# Open MPI refuses to run as root without these; two ranks may exceed the cores of a small machine.
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPIRUN_ARGS = ["--oversubscribe"]


def _has_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def job(tmp_path: Path):
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    out.mkdir()
    return tmp_path, out, cli_env(home, **ROOT_OK)


@pytest.mark.skipif(not _has_mpi4py(), reason="mpi4py is not installed (pip install mpi4py)")
def test_mpirun_forms_group_by_mpi_discovery(job):
    cwd, out, env = job
    # No RANK/WORLD_SIZE/MASTER_*: init_distributed must discover them through mpi4py (the port is the
    # distributed_port default unless MASTER_PORT is exported, which keeps parallel test runs apart).
    cmd = [
        "mpirun",
        "-np",
        "2",
        *MPIRUN_ARGS,
        "-x",
        f"MASTER_PORT={free_port()}",
        sys.executable,
        str(SCRIPTS / "report.py"),
        str(out),
    ]
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    ranks = reports(out)
    assert sorted(ranks) == [0, 1]
    for rank, r in ranks.items():
        assert r["sum"] == 3.0 and r["world_size"] == 2 and r["local_rank"] == rank
        assert r["env"]["MASTER_ADDR"] == "127.0.0.1"  # every rank on rank 0's host
        assert r["env"]["LOCAL_WORLD_SIZE"] == "2"


def test_mpirun_without_mpi4py_uses_ompi_variables(job):
    cwd, out, env = job
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"  # as if mpi4py were not installed
        f"sys.argv = ['report.py', {str(out)!r}]\n"
        f"exec(open({str(SCRIPTS / 'report.py')!r}).read())\n"
    )
    cmd = ["mpirun", "-np", "2", *MPIRUN_ARGS, "-x", f"MASTER_PORT={free_port()}", sys.executable, "-c", code]
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    ranks = reports(out)
    assert sorted(ranks) == [0, 1] and all(r["sum"] == 3.0 for r in ranks.values())


def test_dsfunc_openmpi_launcher(job):
    cwd, out, env = job
    port = free_port()
    args = [
        "--launcher",
        "openmpi",
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
        f"--launcher_args={' '.join(MPIRUN_ARGS)}",
        str(SCRIPTS / "report.py"),
        str(out),
    ]
    res = run_dsfunc(args, cwd, env)
    assert res.returncode == 0, res.stderr
    assert "mpirun -n 2 --hostfile " in res.stderr
    ranks = reports(out)
    assert sorted(ranks) == [0, 1]
    for rank, r in ranks.items():
        assert r["sum"] == 3.0 and r["argv"] == [f"--local_rank={rank}", str(out)]
        assert (r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) == ("127.0.0.1", str(port))


def test_openmpi_failure_and_sigint(job):
    cwd, out, env = job
    base = [
        "--launcher",
        "openmpi",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        f"--launcher_args={' '.join(MPIRUN_ARGS)}",
    ]
    res = run_dsfunc([*base, str(SCRIPTS / "fail.py"), "--sleep"], cwd, env, timeout=STOPPED_WITHIN_S)
    assert res.returncode != 0
    assert "RuntimeError: boom from rank 1" in res.stderr
    assert not wait_gone(str(SCRIPTS / "fail.py"))

    proc = start_dsfunc([*base, str(SCRIPTS / "sleeper.py"), str(out)], cwd, env)
    wait_for_files([out / "ready0", out / "ready1"], proc)
    code, err = interrupt_and_wait(proc)
    assert code == 130, err
    assert not wait_gone(str(out)), "ranks survived the launcher"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs to run as root")
def test_openmpi_as_root_says_how_to_allow_it(job, monkeypatch, capsys):
    """Refused in this process; test_bind_cores_to_rank_under_mpirun runs a job as root with the flag."""
    cwd, out, _ = job
    for key in ROOT_OK:
        monkeypatch.delenv(key, raising=False)
    base = ["--launcher", "openmpi", "--num_gpus", "2", "--master_port", str(free_port())]
    code, err = run_dsfunc_here([*base, f"--launcher_args={' '.join(MPIRUN_ARGS)}", str(SCRIPTS / "report.py"),
                                 str(out)], cwd, cwd / "home", monkeypatch, capsys)
    assert code == 2, err
    assert ("you are root, and Open MPI's mpirun refuses to run as root unless told it may: pass "
            "--launcher_args=--allow-run-as-root") in err
    assert "mpirun -n 2" not in err and not reports(out)  # refused before mpirun starts


def test_bind_cores_to_rank_under_mpirun(job):
    """Also: as root, --allow-run-as-root in --launcher_args (without Open MPI's variables) lets mpirun run."""
    cwd, out, env = job
    for key in ROOT_OK:
        del env[key]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 CPU cores")
    mpirun_args = [*MPIRUN_ARGS, "--bind-to", "none", "--allow-run-as-root"]
    args = ["--launcher", "openmpi", "--num_gpus", "2", "--master_port", str(free_port()), "--bind_cores_to_rank",
            f"--launcher_args={' '.join(mpirun_args)}", str(SCRIPTS / "report.py"), str(out)]
    res = run_dsfunc(args, cwd, env)
    assert res.returncode == 0, res.stderr
    per_rank = len(cores) // 2
    assert sorted(reports(out)) == [0, 1]
    for rank, r in reports(out).items():
        assert r["cpus"] == cores[rank * per_rank : (rank + 1) * per_rank]
