"""Launcher flags with values that cannot work are refused by the real CLI before any rank starts (exit 2,
the flag and the fix named), instead of a traceback from torch's rendezvous or a rank dying on its own. Each
value is checked through the CLI's entry point in this process; one, through a real `dsfunc` process."""

from __future__ import annotations

import os

import pytest

from dsfunc.launcher.flags import parse_launcher_args
from tests.launcher.scripts.harness import SCRIPTS, cli_env, reports, run_dsfunc, run_dsfunc_here

REPORT = str(SCRIPTS / "report.py")
_UNAVAILABLE = max(os.sched_getaffinity(0)) + 1  # a core this machine does not give us


_REFUSED = [
    (["--num_gpus", "0"], "argument --num_gpus/--num_accelerators: 0 starts nothing; give a count >= 1"),
    (["--num_gpus", "2", "--num_nodes", "0"], "argument --num_nodes: 0 starts nothing"),
    (["--num_gpus", "-3"], "-3 starts nothing; give a count >= 1, or -1 (the default) for all"),
    (["--num_gpus", "two"], "argument --num_gpus/--num_accelerators: 'two' is not a whole number"),
    (["--num_gpus", "2", "--master_port", "99999"], "--master_port: 99999 is not a TCP port; give one in 1-65535"),
    (["--num_gpus", "2", "--master_port", "0"], "--master_port: 0 is not a TCP port"),
    (["--num_gpus", "2", "--ssh_port", "70000"], "--ssh_port: 70000 is not a TCP port"),
    (["--num_gpus", "2", "--master_addr", "no such host"], "'no such host' is neither a host name nor an IP"),
    (["--num_gpus", "2", "--collective_timeout", "-1"], "--collective_timeout: '-1' is not a number of seconds >= 0"),
    (["--num_gpus", "2", "--collective_timeout", "nan"], "--collective_timeout: 'nan' is not a number of seconds"),
    (["--num_gpus", "2", "--bind_cores_to_rank", "--bind_core_list", f"0,{_UNAVAILABLE}"],
     f"core(s) {_UNAVAILABLE} are not available here"),
]


@pytest.mark.parametrize("args, message", _REFUSED)
def test_impossible_flag_values_are_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "home").mkdir()
    code, err = run_dsfunc_here([*args, REPORT, str(tmp_path)], tmp_path, tmp_path / "home", monkeypatch, capsys)
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err and not reports(tmp_path)


def test_a_refused_flag_ends_the_process_with_code_2_and_no_traceback(tmp_path):
    args, message = _REFUSED[4]  # --master_port 99999
    (tmp_path / "home").mkdir()
    res = run_dsfunc([*args, REPORT, str(tmp_path)], tmp_path, cli_env(tmp_path / "home"), timeout=120)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr
    assert "Traceback" not in res.stderr and not reports(tmp_path)


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "[::1]", "localhost", "worker-0.cluster.local"])
def test_rendezvous_addresses_that_are_valid_pass(address):
    assert parse_launcher_args(["--master_addr", address, "train.py"]).master_addr == address
