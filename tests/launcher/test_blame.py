"""Which rank the launcher names when a job fails: the one that ended, hung or was killed first, never the
ranks that then failed because of it (real ranks under the elastic agent, gloo on the CPU, real signals)."""

from __future__ import annotations

import re

from tests.launcher.scripts.harness import (
    SCRIPTS,
    STOPPED_WITHIN_S,
    free_port,
    run_dsfunc,
    wait_gone,
)

HANG = str(SCRIPTS / "hang.py")


def _launch(job, *args: str, env: dict[str, str] | None = None):
    cwd, _, base = job
    return run_dsfunc(["--num_gpus", "2", "--master_port", str(free_port()), *args], cwd, {**base, **(env or {})},
                      timeout=STOPPED_WITHIN_S)


def test_a_rank_killed_after_the_others_finished_their_program_is_named(job):
    """Rank 0's program has ended (its interpreter waits for a thread) when rank 1 is SIGKILLed: rank 1 is the
    failure and its signal the job's code; rank 0, stopped by the agent, is no failure."""
    res = _launch(job, str(SCRIPTS / "killed_late.py"))
    assert res.returncode == 128 + 9, res.stderr
    assert "dsfunc: rank 1 (local rank 1 on localhost) failed with signal SIGKILL\n" in res.stderr, res.stderr
    assert ("dsfunc: rank 0 (local rank 0 on localhost) also stopped with signal SIGTERM, after its program had "
            "ended with code 0") in res.stderr
    assert not wait_gone(str(SCRIPTS / "killed_late.py"))


def test_a_rank_that_exits_0_early_is_named_before_the_rank_it_broke(job):
    res = _launch(job, str(SCRIPTS / "leave_early.py"))
    assert res.returncode == 1, res.stderr
    left = "dsfunc: rank 1 (local rank 1 on localhost) exited with code 0 early, before the others had finished"
    broke = "dsfunc: rank 0 (local rank 0 on localhost) then failed with exit code 1"
    assert left in res.stderr and broke in res.stderr, res.stderr
    assert res.stderr.index(left) < res.stderr.index(broke)
    assert res.stderr.count("Connection closed by peer") == 1  # rank 0's traceback, once: in the report


def test_a_rank_that_never_reaches_a_collective_is_named_and_stopped(job):
    res = _launch(job, "--collective_timeout", "3", HANG)
    assert res.returncode == 128 + 15, res.stderr
    assert "dsfunc: rank 1 on localhost hung: it has not reached the collective rank 0 waited in for" in res.stderr
    assert f"(all_reduce at {HANG}:" in res.stderr and "(--collective_timeout 3; 0 turns this off)" in res.stderr
    report = res.stderr.split("dsfunc: rank 1 (local rank 1 on localhost) failed with signal SIGTERM, stopped by "
                              "dsfunc as hung: it has not reached the collective rank 0 waited in for")[1]
    assert f'File "{HANG}", line' in report and "time.sleep(3000)" in report  # where rank 1 was
    assert "shim.py" not in report  # the stack starts in the program
    assert "dsfunc: rank 0 (local rank 0 on localhost) also stopped with" in report
    assert not wait_gone(HANG)


def test_ranks_waiting_in_different_collectives_are_all_stopped(job):
    """The timeout from the variable instead of the flag (the default, 600 s, would outlast the launch's)."""
    res = _launch(job, HANG, "--mismatch", env={"DSFUNC_COLLECTIVE_TIMEOUT": "3"})
    assert res.returncode == 128 + 15, res.stderr
    assert ("dsfunc: ranks 0, 1 on localhost hung: every rank here waits in a collective that the others are not "
            f"in (or for ranks on other nodes): rank 0 in all_reduce at {HANG}:") in res.stderr, res.stderr
    assert f"; rank 1 in barrier at {HANG}:" in res.stderr
    assert not wait_gone(HANG)


def test_a_process_group_timeout_names_the_rank_waited_for(job):
    """The program's own process group times out (5 s) before dsfunc's watch would act (0: it never stops a
    rank): rank 0's timeout is the failure, and the report says rank 1 had not reached the collective, and
    where it was. Rank 0 takes a second to end after the timeout, so its sampler surely sees it out of the
    collective first ([Note: a wait that ends in an error])."""
    cwd, _, _ = job
    script = cwd / "short_timeout.py"
    script.write_text("import datetime, time, torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=5))\n"
                      "if dist.get_rank() == 1:\n    time.sleep(60)\n"
                      "try:\n    dist.all_reduce(torch.ones(1))\n"
                      "except RuntimeError:\n    time.sleep(1)\n    raise\n")
    res = _launch(job, "--collective_timeout", "0", "--no_local_rank", str(script))
    assert res.returncode == 1, res.stderr
    assert "hung" not in res.stderr and "dsfunc: rank 0 (local rank 0 on localhost) failed with exit code 1" in res.stderr
    named = re.split(r"dsfunc: rank 1 \(local rank 1 on localhost\) had not reached the collective rank 0 waited in "
                     rf"for \d+ s \(all_reduce at {re.escape(str(script))}:6\); ", res.stderr)[1]
    assert f'File "{script}", line 4, in <module>\n      time.sleep(60)' in named, res.stderr
