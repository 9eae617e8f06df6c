"""Watching a job's runner processes: one failing, or SIGINT/SIGTERM, stops them all, within a grace period.

A runner process is one per node (ssh), or one for the whole job (mpirun, srun, pdsh). Each kind is asked
to stop its own way (:func:`close_stdin`, :func:`terminate`, pdsh's double SIGINT), and killed if it has
not stopped after :data:`STOP_GRACE_S`. pdsh and srun run many ranks, so the node or rank that failed, and
its code, are read from their stderr.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

#: How long a node may take to stop its ranks after being asked (the elastic agent waits 30 s before SIGKILL).
STOP_GRACE_S = 40.0


_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
#: The launcher's own messages below this level are not shown (--log_level, --quiet); failures always are.
LOG_LEVEL_VARIABLE = "DSFUNC_LAUNCHER_LOG_LEVEL"


def say(message: str, level: str = "info") -> None:
    """One line of launcher news on stderr, prefixed ``dsfunc:`` like the ranks' failure reports; shown when
    ``level`` is at least the launcher's log level (``DSFUNC_LAUNCHER_LOG_LEVEL``, set from --log_level)."""
    if _LEVELS[level] >= _LEVELS.get(os.environ.get(LOG_LEVEL_VARIABLE, "info"), 20):
        print(f"dsfunc: {message}", file=sys.stderr, flush=True)


class _Signals:
    """Turns SIGINT/SIGTERM into a flag the supervision loop polls (restored on exit)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Signals:  # noqa: PYI034 - a private class, never subclassed
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> None:
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def supervise_nodes(
    procs: list[subprocess.Popen],
    labels: list[str],
    ask_stop: Callable[[subprocess.Popen], None],
    node_failure: Callable[[], tuple[str, int] | None] = lambda: None,
) -> int:
    """Wait for the runner processes (one per node, or one mpirun/srun/pdsh); when one fails,
    ``node_failure()`` reports a failed node or rank (label, code; its code is the job's even when the
    runner has exited too), or a signal arrives, ``ask_stop(proc)`` the others and wait for them to finish
    (killing them after :data:`STOP_GRACE_S`). Returns the job's exit code."""
    with _Signals() as signals:
        code = 0
        while True:
            failed = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            remote = node_failure()
            if remote is not None:  # names the failing node or rank, and its code, unlike its runner's exit
                code = remote[1]
                stopping = "; stopping every node" if any(p.poll() is None for p in procs) else ""
                say(f"{remote[0]} exited with code {code}{stopping}", "error")
                break
            if failed:
                i, code = failed[0]
                others = "; stopping the other nodes" if any(p.poll() is None for p in procs) else ""
                say(f"{labels[i]} exited with code {code}{others}", "error")
                break
            if signals.received is not None:
                code = 128 + signals.received
                say(f"got {signal.Signals(signals.received).name}; stopping every rank", "warning")
                break
            if all(p.poll() == 0 for p in procs):
                return 0
            time.sleep(0.1)
        running = [p for p in procs if p.poll() is None]
        for p in running:
            ask_stop(p)
        _wait_all(running, time.monotonic() + STOP_GRACE_S)
        return code


def close_stdin(proc: subprocess.Popen) -> None:
    """Ask an ssh node to stop: its agent stops its ranks when ssh's stdin closes."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()


def terminate(proc: subprocess.Popen) -> None:
    """Ask mpirun or srun (started in its own session) to stop its ranks."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def _interrupt_pdsh(proc: subprocess.Popen) -> None:
    """Two SIGINTs within a second make pdsh SIGTERM its ssh sessions; each node's agent then sees its
    parent (the remote sshd session) exit and stops its ranks."""
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)


_PDSH_NODE_EXIT = re.compile(r"^pdsh@\S+: (\S+): ssh exited with exit code (\d+)")


def _relay_pdsh_errors(stream, failures: list[tuple[str, int]]) -> None:
    """Copy pdsh's stderr to ours, noting each node whose command failed (pdsh waits for all nodes)."""
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        match = _PDSH_NODE_EXIT.match(line)
        if match and int(match[2]) != 0:
            failures.append((f"node {match[1]}", int(match[2])))


def supervise_pdsh(proc: subprocess.Popen) -> int:
    """:func:`supervise_nodes` for a pdsh started with ``stderr=PIPE``: pdsh only exits once every node is
    done, so a node's failure is read from pdsh's stderr (relayed to ours) to stop the others early."""
    failures: list[tuple[str, int]] = []
    relay = threading.Thread(target=_relay_pdsh_errors, args=(proc.stderr, failures), daemon=True)
    relay.start()
    code = supervise_nodes([proc], ["pdsh"], _interrupt_pdsh, lambda: failures[0] if failures else None)
    relay.join(timeout=5)
    return code


# srun's report of tasks that failed: "srun: error: HOST: task 1: Exited with exit code 3" (or "tasks 0-1",
# or a signal's name, as strsignal(3) spells it, such as "Killed" or "Segmentation fault (core dumped)").
_SRUN_TASK_END = re.compile(rb"^srun: error: (\S+): tasks? ([\d,-]+): (.+?)(?: \(core dumped\))?$")
_SIGNAL_NAMES = {signal.strsignal(s).encode(): s for s in signal.Signals if signal.strsignal(s)}


def srun_task_failure(line: bytes) -> tuple[str, int] | None:
    """The ranks (``SLURM_PROCID``) and exit code (128 + signal for a signal) of a failed task that a line of
    srun's stderr reports, or None for any other line."""
    match = _SRUN_TASK_END.match(line.rstrip(b"\r\n"))
    if match is None:
        return None
    host, tasks, how = (g.decode(errors="replace") for g in match.groups())
    if how.startswith("Exited with exit code ") and how.rsplit(" ", 1)[1].isdigit():
        code = int(how.rsplit(" ", 1)[1])
    elif how.encode() in _SIGNAL_NAMES:
        code = 128 + _SIGNAL_NAMES[how.encode()]
    else:
        return None
    return (f"rank {tasks} on {host}" if tasks.isdigit() else f"ranks {tasks} on {host}"), code


def _relay_srun_errors(stream, failures: list[tuple[str, int]]) -> None:
    """Copy srun's stderr (its own messages and the ranks' stderr) to ours as it comes, noting each failed
    task srun reports."""
    pending = b""
    while chunk := stream.read1(65536):
        sys.stderr.buffer.write(chunk)
        sys.stderr.buffer.flush()
        *lines, pending = (pending + chunk).split(b"\n")
        failures.extend(f for f in map(srun_task_failure, lines) if f is not None and f[1] != 0)


def ending_failure(failures: list[tuple[str, int]]) -> tuple[str, int]:
    """The failure that ended the step: the first srun reported that is not one of the tasks it then stopped
    itself with SIGTERM (``--kill-on-bad-exit``), which it may report first."""
    stopped = 128 + signal.SIGTERM
    return next((f for f in failures if f[1] != stopped), failures[0])


def supervise_srun(proc: subprocess.Popen) -> int:
    """:func:`supervise_nodes` for an srun started with ``stderr=PIPE`` (binary). srun exits with the highest
    code of its tasks; once one fails it stops the others itself (``--kill-on-bad-exit``, SIGTERM: 143). So a
    failure is acted on once srun has exited and its stderr is read to the end: srun reports a task's exit
    before it may have forwarded that task's last output (its traceback), and stopping srun then would lose
    it. The job's code is that of the task whose failure ended the step (:func:`ending_failure`); srun is stopped by
    dsfunc only when it has not ended :data:`STOP_GRACE_S` after reporting one."""
    failures: list[tuple[str, int]] = []
    relay = threading.Thread(target=_relay_srun_errors, args=(proc.stderr, failures), daemon=True)
    relay.start()
    first_seen: list[float] = []

    def cause() -> tuple[str, int] | None:
        if proc.poll() is not None:
            relay.join(timeout=STOP_GRACE_S)  # srun is gone: read every task's last output, and its report
            return ending_failure(failures) if failures else None
        if failures and not first_seen:
            first_seen.append(time.monotonic())
        if first_seen and time.monotonic() - first_seen[0] > STOP_GRACE_S:
            return ending_failure(failures)
        return None

    code = supervise_nodes([proc], ["srun"], terminate, cause)
    relay.join(timeout=STOP_GRACE_S)
    return code
