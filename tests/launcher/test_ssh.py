"""Multi-node launches over real ssh: a private sshd on a loopback port; two host aliases = two nodes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.launcher.scripts.harness import (
    SCRIPTS,
    STOPPED_WITHIN_S,
    Sshd,
    cli_env,
    free_port,
    interrupt_and_wait,
    reports,
    run_dsfunc,
    sshd_missing_reason,
    start_dsfunc,
    wait_for_files,
    wait_gone,
)

REPORT = str(SCRIPTS / "report.py")

pytestmark = pytest.mark.skipif(sshd_missing_reason() is not None, reason=str(sshd_missing_reason()))


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = Sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def job(tmp_path: Path, sshd: Sshd):
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    out.mkdir()
    base = [
        "--hostfile",
        str(sshd.hostfile()),
        "--launcher_args",
        f"-F {sshd.config}",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
    return tmp_path, out, cli_env(home), base


def test_world_over_ssh_with_include_env_file_and_venv_script(job):
    """One launch (each costs tens of seconds here) checks an uneven world chosen by --include (rank, node,
    local rank), the env file, the forwarded variables and the --venv_script sourced on every node."""
    cwd, out, env, base = job
    (cwd / ".deepspeed_env").write_text("DSFUNC_TEST_VAR=from env file\n")
    env["UCX_TEST_VAR"] = "forwarded"
    script = cwd / "activate"
    script.write_text("export DSFUNC_TEST_VENV=sourced\n")
    res = run_dsfunc([*base, "--include", "node-a:1@node-b", "--venv_script", str(script), REPORT, str(out)], cwd,
                     env)
    assert res.returncode == 0, res.stderr
    assert "3 rank(s) on 2 node(s) (node-a: slots 1; node-b: slots 0,1)" in res.stderr
    ranks = reports(out)
    assert sorted(ranks) == [0, 1, 2]
    where = {0: ("0", "0", "1"), 1: ("1", "0", "2"), 2: ("1", "1", "2")}  # node, local rank, ranks on the node
    for rank, r in ranks.items():
        assert r["sum"] == 6.0 and r["world_size"] == 3
        e = r["env"]
        assert (e["CROSS_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"]) == (*where[rank], "3")
        assert r["argv"] == [f"--local_rank={where[rank][1]}", str(out)]
        assert e["DSFUNC_TEST_VAR"] == "from env file" and e["UCX_TEST_VAR"] == "forwarded"
        assert e["DSFUNC_TEST_VENV"] == "sourced"
        assert e["PYTHONPATH"].split(":")[0] == str(cwd)
    assert "Error waiting on exit barrier" not in res.stderr


def test_exclude_selects_ranks(job):
    """A job on one node of the hostfile, not its first, still over ssh (--force_multi). (--include:
    test_world_over_ssh_with_include_env_file_and_venv_script.)"""
    cwd, out, env, base = job
    res = run_dsfunc([*base, "--exclude", "node-a", "--force_multi", REPORT, str(out)], cwd, env)
    assert res.returncode == 0, res.stderr
    assert "2 rank(s) on 1 node(s) (node-b: slots 0,1) via ssh" in res.stderr
    ranks = reports(out)
    assert sorted(ranks) == [0, 1]
    for rank, r in ranks.items():
        e = r["env"]
        assert r["sum"] == 3.0 and (e["CROSS_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == ("0", str(rank), "2")
        assert r["argv"] == [f"--local_rank={rank}", str(out)]


def test_rank_failure_on_one_node_stops_all_nodes(job):
    cwd, _, env, base = job
    # the other ranks sleep 300 s: the launcher returning within the timeout means they were stopped
    res = run_dsfunc([*base, str(SCRIPTS / "fail.py"), "--sleep"], cwd, env, timeout=STOPPED_WITHIN_S)
    assert res.returncode == 1, res.stderr
    assert "dsfunc: rank 1 (local rank 1 on node-a) failed with exit code 1" in res.stderr
    assert "RuntimeError: boom from rank 1" in res.stderr.split("failed with exit code 1")[1]
    assert "node 0 (node-a) exited with code 1; stopping the other nodes" in res.stderr
    assert not wait_gone(str(SCRIPTS / "fail.py"))


def test_sigint_stops_every_node_without_orphans(job):
    cwd, out, env, base = job
    proc = start_dsfunc([*base, str(SCRIPTS / "sleeper.py"), str(out)], cwd, env)
    wait_for_files([out / f"ready{r}" for r in range(4)], proc)
    code, err = interrupt_and_wait(proc)
    assert code == 130, err
    survivors = wait_gone(str(out), timeout=5)
    assert not survivors, f"left behind: {survivors}"


def test_unreachable_host_is_a_clear_error(job, sshd):
    cwd, _, env, _ = job
    hostfile = cwd / "hostfile"
    hostfile.write_text("node-a slots=1\nno-such-host.invalid slots=1\n")
    res = run_dsfunc(["--hostfile", str(hostfile), "--launcher_args", f"-F {sshd.config}", REPORT], cwd, env)
    assert res.returncode == 2
    assert "cannot reach no-such-host.invalid with passwordless ssh" in res.stderr


@pytest.mark.skipif(shutil.which("pdsh") is None, reason="pdsh is not installed (apt-get install pdsh)")
def test_pdsh_runner_world_and_failure(job, sshd):
    cwd, out, env, base = job
    env["PDSH_SSH_ARGS_APPEND"] = f"-F {sshd.config}"
    pdsh_base = [a for a in base if a not in ("--launcher_args", f"-F {sshd.config}")] + [
        "--launcher",
        "pdsh",
    ]
    res = run_dsfunc([*pdsh_base, REPORT, str(out)], cwd, env)
    assert res.returncode == 0, res.stderr
    ranks = reports(out)
    assert sorted(ranks) == [0, 1, 2, 3] and all(r["sum"] == 10.0 for r in ranks.values())

    res = run_dsfunc([*pdsh_base, str(SCRIPTS / "fail.py"), "--sleep"], cwd, env, timeout=STOPPED_WITHIN_S)
    assert res.returncode == 1, res.stderr
    assert "node-a: dsfunc: rank 1 (local rank 1 on node-a) failed with exit code 1" in res.stderr
    assert "dsfunc: node node-a exited with code 1; stopping every node" in res.stderr
    assert not wait_gone(str(SCRIPTS / "fail.py"))

