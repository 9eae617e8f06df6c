"""`dsfunc --launcher slurm` against a real single-node slurm (munged, slurmctld, slurmd started here): the
ranks come from srun, form a gloo group, a failing rank ends the job with its exit code, and Ctrl-C stops it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from dsfunc.launcher.supervise import ending_failure, srun_task_failure
from tests.launcher.scripts.harness import (
    SCRIPTS,
    STOPPED_WITHIN_S,
    cli_env,
    free_port,
    interrupt_and_wait,
    reports,
    run_dsfunc,
    start_dsfunc,
    wait_for_files,
    wait_gone,
)
from tests.launcher.slurm_cluster import SlurmCluster, slurm_missing_reason


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_missing_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":  # CI installs slurm: its absence is a broken setup, not a skip
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    left = cluster.stop()
    assert not left, f"the slurm cluster left processes behind: {left}"


@pytest.fixture
def job(tmp_path: Path, slurm: SlurmCluster):
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    out.mkdir()
    base = ["--launcher", "slurm", "--num_nodes", "1", "--num_gpus", "2", "--master_port", str(free_port())]
    return tmp_path, out, slurm.client_env(cli_env(home)), base


def test_two_tasks_through_srun_form_a_group(job):
    cwd, out, env, base = job
    res = run_dsfunc([*base, str(SCRIPTS / "report.py"), str(out)], cwd, env)
    assert res.returncode == 0, res.stderr
    assert "via slurm" in res.stderr and "srun --nodes=1 --ntasks=2 --ntasks-per-node=2" in res.stderr
    ranks = reports(out)
    assert sorted(ranks) == [0, 1]
    for rank, r in ranks.items():
        assert r["sum"] == 3.0 and r["world_size"] == 2 and r["backend"] == "gloo"
        e = r["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank), "2", "2")
        assert r["argv"] == [f"--local_rank={rank}", str(out)]
    assert ranks[0]["pid"] != ranks[1]["pid"]


def test_failing_rank_ends_the_job_with_its_code(job):
    cwd, out, env, base = job
    # rank 0 sleeps 300 s: the launcher returning within the timeout means srun stopped it
    res = run_dsfunc([*base, str(SCRIPTS / "fail.py"), "--sleep", str(out)], cwd, env, timeout=STOPPED_WITHIN_S)
    assert res.returncode == 1, res.stderr
    assert "RuntimeError: boom from rank 1" in res.stderr
    assert "dsfunc: rank 1 on " in res.stderr and "exited with code 1" in res.stderr
    survivors = wait_gone(str(out))
    assert not survivors, f"left behind: {survivors}"


def test_rank_killed_by_a_signal_ends_the_job_with_128_plus_it(job):
    cwd, out, env, base = job
    script = cwd / "killed.py"
    script.write_text(
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(300)\n"
    )
    res = run_dsfunc([*base, str(script), str(out)], cwd, env, timeout=STOPPED_WITHIN_S)
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    assert "dsfunc: rank 1 on " in res.stderr and f"exited with code {128 + signal.SIGKILL}" in res.stderr
    survivors = wait_gone(str(out))
    assert not survivors, f"left behind: {survivors}"


def test_sigint_stops_the_srun_job_without_orphans(job):
    cwd, out, env, base = job
    proc = start_dsfunc([*base, str(SCRIPTS / "sleeper.py"), str(out)], cwd, env)
    wait_for_files([out / "ready0", out / "ready1"], proc, timeout=STOPPED_WITHIN_S)
    code, err = interrupt_and_wait(proc)
    assert code == 130, err
    survivors = wait_gone(str(out))
    assert not survivors, f"left behind: {survivors}"


@pytest.mark.parametrize(
    "line, expected",
    [
        (b"srun: error: vm: task 1: Exited with exit code 3\n", ("rank 1 on vm", 3)),
        (b"srun: error: n[1-2]: tasks 0-3,5: Exited with exit code 1", ("ranks 0-3,5 on n[1-2]", 1)),
        (b"srun: error: vm: task 0: Terminated", ("rank 0 on vm", 143)),
        (b"srun: error: vm: task 2: Segmentation fault (core dumped)", ("rank 2 on vm", 139)),
        (b"srun: error: vm: task 2: Exited with exit code 0", ("rank 2 on vm", 0)),
        (b"srun: error: Unable to create step for job 7: Invalid node name", None),
        (b"task 1: Exited with exit code 3", None),  # a rank's own output, not srun's
    ],
)
def test_srun_task_failure_lines(line, expected):
    assert srun_task_failure(line) == expected


@pytest.mark.parametrize(
    "reported, expected",
    [
        ([("rank 1 on vm", 1), ("rank 0 on vm", 143)], ("rank 1 on vm", 1)),
        ([("rank 0 on vm", 143), ("rank 1 on vm", 1)], ("rank 1 on vm", 1)),  # srun's own SIGTERM reported first
        ([("rank 0 on vm", 143), ("rank 1 on vm", 137)], ("rank 1 on vm", 137)),
        ([("rank 1 on vm", 143), ("rank 0 on vm", 143)], ("rank 1 on vm", 143)),  # a rank SIGTERMed from outside
    ],
)
def test_the_failure_that_ended_the_step_is_not_one_srun_stopped(reported, expected):
    assert ending_failure(reported) == expected
