"""What a first-time user meets: a busy port, the same error on every rank, Ctrl-C and ``--version`` each
give a line or two that say what happened and what to do, not tracebacks (real launches, real signals)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest
import torch

from dsfunc.cli import main
from dsfunc.version import package_version
from tests.launcher.scripts.harness import (
    SCRIPTS,
    STOPPED_WITHIN_S,
    dsfunc_cmd,
    free_port,
    run_dsfunc,
    wait_for_files,
    wait_gone,
)

REPORT = str(SCRIPTS / "report.py")


def test_a_busy_master_port_is_one_line_saying_what_to_do(job):
    cwd, out, env = job
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_dsfunc(["--num_gpus", "2", "--master_port", str(port), REPORT, str(out)], cwd, env)
    assert res.returncode == 2, res.stderr
    assert (f"dsfunc: error: the rendezvous port {port} is in use on localhost (another job, or one still "
            "stopping); pass another --master_port, or, for a job on this machine alone, leave --master_port out "
            "to use a free one") in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) <= 3, res.stderr


def test_without_master_port_a_job_here_takes_a_free_port_when_the_default_is_busy(job):
    cwd, out, env = job
    with socket.socket() as taken:
        try:
            taken.bind(("", 29500))
        except OSError:
            pytest.skip("port 29500 is taken by another process, which may free it at any time")
        taken.listen()
        res = run_dsfunc(["--num_gpus", "2", REPORT, str(out)], cwd, env)
    assert res.returncode == 0, res.stderr
    assert "dsfunc: port 29500 is in use; the rendezvous takes the free port " in res.stderr


def test_the_same_error_on_every_rank_is_printed_once(job):
    cwd, _, env = job
    res = run_dsfunc(["--num_gpus", "3", "--master_port", str(free_port()), str(SCRIPTS / "bad_config.py")], cwd,
                     env, timeout=STOPPED_WITHIN_S)
    assert res.returncode == 1, res.stderr
    assert res.stderr.count('optimizer.type = "Adamx"') == 1, res.stderr
    assert "dsfunc: ranks 0, 1, 2 (on localhost) failed with exit code 1, each with this error" in res.stderr
    assert 'bad_config.py", line 8, in <module>' in res.stderr
    assert "dsfunc/config" not in res.stderr  # dsfunc's own error says what to do: its frames add nothing
    assert len(res.stderr.splitlines()) <= 8, res.stderr


def test_ctrl_c_stops_every_rank_with_one_line_and_code_130(job):
    """SIGINT to the whole foreground process group, as a terminal's Ctrl-C sends it."""
    cwd, out, env = job
    args = ["--num_gpus", "2", "--master_port", str(free_port()), str(SCRIPTS / "sleeper.py"), str(out)]
    proc = subprocess.Popen(dsfunc_cmd(*args), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    wait_for_files([out / "ready0", out / "ready1"], proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=STOPPED_WITHIN_S)
    assert proc.returncode == 130, err
    assert "dsfunc: interrupted by SIGINT: every rank of localhost stopped" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not wait_gone(str(out)), "processes of the job survived the launcher"


def test_version_names_dsfunc_and_torch(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dsfunc {package_version()} (torch {torch.__version__}, Python "), out


def test_a_collective_timeout_variable_that_is_not_seconds_is_a_clear_error(job):
    cwd, out, env = job
    res = run_dsfunc(["--num_gpus", "2", REPORT, str(out)], cwd, {**env, "DSFUNC_COLLECTIVE_TIMEOUT": "soon"})
    assert res.returncode == 2, res.stderr
    assert ("dsfunc: error: DSFUNC_COLLECTIVE_TIMEOUT: 'soon' is not a number of seconds >= 0; set it to one, or "
            "unset it for the default") in res.stderr
