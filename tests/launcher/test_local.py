"""The `dsfunc` launcher on one machine: real ranks under PyTorch's elastic agent, gloo on the CPU."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from dsfunc.cli import main
from tests.launcher.scripts.harness import (
    SCRIPTS,
    STOPPED_WITHIN_S,
    free_port,
    interrupt_and_wait,
    reports,
    run_dsfunc,
    run_dsfunc_here,
    start_dsfunc,
    wait_for_files,
    wait_gone,
)

REPORT = str(SCRIPTS / "report.py")


def test_two_cpu_ranks_all_reduce(job):
    cwd, out, env = job
    (cwd / ".deepspeed_env").write_text("# comment\n\nDSFUNC_TEST_FROM_FILE=hello world\n")
    env["NCCL_DEBUG_TEST"] = "forwarded"
    port = free_port()
    res = run_dsfunc(
        # --log and --max abbreviate torchrun options: the script must still get them untouched
        ["--num_gpus", "2", "--master_port", str(port), REPORT, "--log", "x", "--max", str(out)], cwd, env
    )
    assert res.returncode == 0, res.stderr
    ranks = reports(out)
    assert sorted(ranks) == [0, 1]
    for rank, r in ranks.items():
        assert r["sum"] == 3.0 and r["world_size"] == 2
        assert r["argv"] == [f"--local_rank={rank}", "--log", "x", "--max", str(out)]
        e = r["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            "2",
            "2",
        )
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert e["DSFUNC_TEST_FROM_FILE"] == "hello world" and e["NCCL_DEBUG_TEST"] == "forwarded"
        assert "CUDA_VISIBLE_DEVICES" not in e  # no GPU here: nothing to select
        assert e["OMP_NUM_THREADS"] == "1"  # the user's value (cli_env's) wins, without a word
    assert "OMP_NUM_THREADS" not in res.stderr


def test_module_and_no_local_rank(job):
    cwd, out, env = job
    args = [
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--no_local_rank",
        "-q",  # a job that ends well prints no launcher line
        "--module",
        "tests.launcher.scripts.report",
        str(out),
    ]
    res = run_dsfunc(args, cwd, env)
    assert res.returncode == 0 and "dsfunc:" not in res.stderr, res.stderr
    ranks = reports(out)
    assert sorted(ranks) == [0, 1] and all(r["argv"] == [str(out)] for r in ranks.values())


def test_no_python_and_each_rank_log(job):
    cwd, _, env = job
    logs = cwd / "logs"
    program = cwd / "rank.sh"
    program.write_text('#!/bin/sh\necho "rank $RANK of $WORLD_SIZE args $*"\necho oops >&2\n')
    program.chmod(0o755)
    args = [
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--enable_each_rank_log",
        str(logs),
        "--no_python",
        str(program),
        "a b",
    ]
    res = run_dsfunc(args, cwd, env)
    assert res.returncode == 0, res.stderr
    files = sorted(logs.iterdir())
    assert [f.name.split("_", 1)[1] for f in files] == ["rank0.log", "rank1.log"]
    assert files[0].name[:14].isdigit()
    assert files[1].read_text() == "rank 1 of 2 args --local_rank=1 a b\noops\n"


def test_failing_rank_stops_job_and_is_reported(job):
    """Also: --log_level warning keeps the failure report and drops the launcher's news."""
    cwd, _, env = job
    res = run_dsfunc(
        ["--num_gpus", "2", "--master_port", str(free_port()), "--log_level", "warning", str(SCRIPTS / "fail.py"),
         "--sleep"],
        cwd,
        env,
        timeout=STOPPED_WITHIN_S,
    )
    assert res.returncode == 1 and "rank(s) on 1 node(s)" not in res.stderr
    assert "dsfunc: rank 1 (local rank 1 on localhost) failed with exit code 1" in res.stderr
    summary = res.stderr.split("dsfunc: rank 1 (local rank 1")[1]
    assert "RuntimeError: boom from rank 1" in summary and 'fail.py", line' in summary
    assert not wait_gone(str(SCRIPTS / "fail.py"))


def test_max_restarts_reruns_the_ranks(job):
    cwd, out, env = job
    script = cwd / "flaky.py"
    script.write_text(
        "import os, sys\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"  # the first attempt fails on every rank
        "    sys.exit(3)\n"
        f"done = open({str(out)!r} + '/done' + os.environ['RANK'], 'w')\n"
        "done.write(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
    )
    res = run_dsfunc(
        [
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--max_restarts",
            "1",
            "--no_local_rank",
            str(script),
        ],
        cwd,
        env,
    )
    assert res.returncode == 0, res.stderr
    assert (out / "done0").read_text() == "1" and (out / "done1").read_text() == "1"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_every_rank(job, sig):
    cwd, out, env = job
    args = ["--num_gpus", "2", "--master_port", str(free_port()), "--save_pid", str(SCRIPTS / "sleeper.py")]
    proc = start_dsfunc([*args, str(out)], cwd, env)
    wait_for_files([out / "ready0", out / "ready1"], proc)
    rank_pids = [int((out / f"ready{r}").read_text()) for r in range(2)]
    assert Path(f"/tmp/{proc.pid}.dsfunc").read_text() == str(proc.pid)
    code, err = interrupt_and_wait(proc, sig)
    assert code == 128 + sig, err
    assert not wait_gone(str(out)), "processes of the job survived the launcher"
    assert not any(os.path.exists(f"/proc/{pid}") for pid in rank_pids)
    assert not os.path.exists(f"/tmp/{proc.pid}.dsfunc")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--include", "localhost:0"], "no GPU found and no hostfile: --include/--exclude select GPUs"),
        ([], "no GPU found and no hostfile: pass --num_gpus N"),
        (["--num_gpus", "2", "--num_nodes", "2"], "--num_nodes 2 needs other nodes"),
        (["--hostfile", "/nonexistent/hostfile"], "--hostfile /nonexistent/hostfile: no such file"),
        (["--num_gpus", "2", "--module", "--no_python"], "--module and --no_python cannot be used together"),
    ],
)
def test_bad_launch_is_a_clear_error(tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "home").mkdir()
    code, err = run_dsfunc_here([*args, REPORT], tmp_path, tmp_path / "home", monkeypatch, capsys)
    assert code == 2
    assert message in err


def test_bad_env_file_names_file_and_line(job):
    """A real `dsfunc` process: a launch refused before any rank starts ends it with code 2 and one line."""
    cwd, out, env = job
    (cwd / ".dsfunc_env").write_text("GOOD=1\n\nnot a pair\n")
    res = run_dsfunc(["--num_gpus", "2", REPORT, str(out)], cwd, env, timeout=60)
    assert res.returncode == 2
    assert res.stderr.startswith(f"dsfunc: error: {cwd / '.dsfunc_env'}:3: expected KEY=VALUE")
    assert len(res.stderr.splitlines()) == 1 and not reports(out)


def test_export_subcommand_is_dispatched(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--help"])
    assert exit_.value.code == 0
    assert "usage: dsfunc export" in capsys.readouterr().out


def test_no_ssh_nodes_started_by_hand_form_one_world(job):
    cwd, out, env = job
    hostfile = cwd / "hostfile"
    hostfile.write_text("first slots=2\nsecond slots=1\n")  # uneven nodes: 2 + 1 ranks
    base = [
        "--hostfile",
        str(hostfile),
        "--no_ssh",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
    procs = [
        start_dsfunc([*base, "--node_rank", str(k), REPORT, str(out)], cwd, env)
        for k in (0, 1)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    ranks = reports(out)
    assert sorted(ranks) == [0, 1, 2] and all(r["sum"] == 6.0 for r in ranks.values())
    assert [(r["env"]["LOCAL_RANK"], r["env"]["LOCAL_WORLD_SIZE"]) for _, r in sorted(ranks.items())] == [
        ("0", "2"),
        ("1", "2"),
        ("0", "1"),
    ]
    assert not any("Error waiting on exit barrier" in err for _, err in results)


def test_no_ssh_with_a_node_rank_past_the_hostfile_is_an_error(job):
    cwd, out, env = job
    hostfile = cwd / "hostfile"
    hostfile.write_text("first slots=2\nsecond slots=1\n")
    res = run_dsfunc(["--hostfile", str(hostfile), "--no_ssh", "--node_rank", "2", "--master_addr", "127.0.0.1",
                      REPORT, str(out)], cwd, env)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "--node_rank 2 names no node: the job has 2 (first, second); give 0 to 1" in res.stderr


@pytest.mark.parametrize("how", ["sys.exit", "os._exit"])
def test_the_rank_that_failed_first_is_reported_with_its_exit_code(job, how):
    """Rank 1 exits 3 without a traceback while rank 0 waits in an all-reduce (which then breaks, or torch
    elastic stops it): rank 1 is the failure, not rank 0's gloo error or SIGTERM, and dsfunc exits 3."""
    cwd, _, env = job
    args = ["--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPTS / "exit_quietly.py")]
    res = run_dsfunc([*args, *(["--os-exit"] if how == "os._exit" else [])], cwd, env, timeout=STOPPED_WITHIN_S)
    assert res.returncode == 3, res.stderr
    # (torch elastic may stop rank 1 with SIGTERM while its interpreter shuts down after sys.exit(3))
    assert re.search(r"^dsfunc: rank 1 \(local rank 1 on localhost\) failed with exit code 3"
                     r"( \(its shutdown then stopped by signal SIGTERM\))?$", res.stderr, re.MULTILINE), res.stderr
    assert "  (no Python traceback was recorded; see the rank's output above)" in res.stderr
    assert "dsfunc: rank 0 (local rank 0 on localhost) also stopped with " in res.stderr
    assert "failed (exitcode:" not in res.stderr  # torch elastic's own guess is not repeated
    assert not wait_gone(str(SCRIPTS / "exit_quietly.py"))


def test_a_missing_script_is_an_error_before_any_rank_starts(job):
    cwd, _, env = job
    res = run_dsfunc(["--num_gpus", "2", "--master_port", str(free_port()), "missing.py"], cwd, env, timeout=60)
    assert res.returncode == 2, res.stderr
    assert (f"dsfunc: error: on localhost, the script 'missing.py' does not exist (working directory {cwd}); "
            "for a module pass --module") in res.stderr
    assert "FileNotFoundError" not in res.stderr and "Traceback" not in res.stderr


def test_threads_per_rank_are_the_cores_shared_out_in_one_line(job):
    cwd, out, env = job
    del env["OMP_NUM_THREADS"]
    res = run_dsfunc(["--num_gpus", "2", "--master_port", str(free_port()), REPORT, str(out)], cwd, env)
    assert res.returncode == 0, res.stderr
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert all(r["env"]["OMP_NUM_THREADS"] == str(threads) and r["threads"] == threads
               for r in reports(out).values())
    assert f"dsfunc: OMP_NUM_THREADS={threads} for each of 2 local rank(s)" in res.stderr
    assert "*****" not in res.stderr and "Setting OMP_NUM_THREADS environment variable" not in res.stderr
    # (the user's OMP_NUM_THREADS winning is checked by test_two_cpu_ranks_all_reduce)


def test_bind_cores_to_rank_gives_each_rank_its_share_of_the_cores(job):
    cwd, out, env = job
    del env["OMP_NUM_THREADS"]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 CPU cores")
    args = ["--num_gpus", "2", "--master_port", str(free_port()), "--bind_cores_to_rank", REPORT, str(out)]
    res = run_dsfunc(args, cwd, env)
    assert res.returncode == 0, res.stderr
    per_rank = len(cores) // 2
    for rank, r in reports(out).items():
        mine = cores[rank * per_rank : (rank + 1) * per_rank]
        assert r["cpus"] == mine  # read back in the rank: sched_getaffinity and /proc/self/status agree
        assert r["cpus_allowed_list"] == (f"{mine[0]}-{mine[-1]}" if len(mine) > 1 else str(mine[0]))
        assert r["env"]["OMP_NUM_THREADS"] == str(per_rank)
    last = str(cores[-1])
    args = ["--num_gpus", "1", "--master_port", str(free_port()), "--bind_cores_to_rank", "--bind_core_list", last,
            REPORT, str(out)]
    res = run_dsfunc(args, cwd, env)
    assert res.returncode == 0, res.stderr
    assert reports(out)[0]["cpus_allowed_list"] == last


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bind_core_list", "0"], "--bind_core_list lists the cores for --bind_cores_to_rank; pass that flag too"),
        (["--bind_cores_to_rank", "--bind_core_list", "3-1"], "ranges must be ascending and must not overlap"),
        (["--bind_cores_to_rank", "--bind_core_list", "0,x"], "'x' is not a core number or a range"),
        (["--bind_cores_to_rank", "--bind_core_list", "0"], "1 core(s) (0) cannot give each of 2 local ranks one"),
        (["--autotuning", "tune"], "--autotuning: DeepSpeed's autotuner is not supported by dsfunc"),
        (["--venv_script", "venv/bin/activate"], "--venv_script applies to the ssh and pdsh launchers"),
    ],
)
def test_deepspeed_flags_dsfunc_cannot_honour_are_clear_errors(tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "home").mkdir()
    code, err = run_dsfunc_here(["--num_gpus", "2", *args, REPORT], tmp_path, tmp_path / "home", monkeypatch, capsys)
    assert code == 2, err
    assert message in err


def test_a_rank_that_ends_well_finishes_what_the_interpreters_exit_would(job):
    """See [Note: ending without finalization]: the rank leaves with ``os._exit``, after its threads, its
    ``atexit`` handlers and its unflushed files, with the process groups still referenced."""
    cwd, out, env = job
    res = run_dsfunc(["--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPTS / "ends_well.py"), str(out)],
                     cwd, env)
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert (out / f"unflushed.{rank}").read_text() == "written, never flushed"
        assert (out / f"thread.{rank}").read_text() == "joined"
        assert (out / f"atexit.{rank}").exists()
    assert "rank 0 ends without a newline" in res.stdout
