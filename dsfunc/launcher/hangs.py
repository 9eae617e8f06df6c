"""A rank that never reaches a collective: found, named and stopped within minutes, not gloo's 30.

[Note: naming a hung rank]
A collective waits for every rank of its group. When one rank hangs before it (a deadlock, a stuck read,
a branch only some ranks take), the others wait until the process group's timeout, 30 minutes by default
for gloo and for DeepSpeed, and then fail naming none: the rank that raised "Timed out waiting for recv"
is the one that waited, not the one it waited for.

So each rank's shim runs a sampler thread that looks at the program's main thread every
:data:`SAMPLE_S` and tells its node agent's clock (:mod:`dsfunc.launcher.exits`) when that thread is
blocked in one of ``torch.distributed``'s collectives (its innermost frame is in ``distributed_c10d.py``:
every collective, barrier and group creation; a ``Work.wait()`` the program calls itself on an async
handle is not seen, and such a hang ends by the group's own timeout). The agent's :class:`HangWatch` then
sees a rank that has waited longer than the collective timeout (:data:`TIMEOUT_VARIABLE`, the launcher's
``--collective_timeout``) and, among this node's live ranks, those that are not waiting: those are hung.
It asks them for their stacks, says which rank waited for which and where each one is, and stops them;
the failure report then names them first. When every live rank of the node waits, they wait for one
another in different collectives or for ranks on other nodes: all are stopped, each named with the
collective it waited in.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback

from dsfunc.launcher.exits import ExitClock, RankState, tell
from dsfunc.launcher.supervise import say

#: Seconds a rank may wait in a collective for the others before the node agent stops the ranks it waits
#: for (the launcher's ``--collective_timeout``; 0: never).
TIMEOUT_VARIABLE = "DSFUNC_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
#: How often a rank's sampler looks at its main thread.
SAMPLE_S = 0.5
_STACK_FRAMES = 8  # the innermost ones, of a hung rank's stack
_STACK_WAIT_S = 3.0  # how long the watch waits for a hung rank's stack before stopping it anyway
# A rank that has waited this long in a collective has the ranks it waits for asked for their stacks (again
# every _ASK_AGAIN_S while it waits): if the process group's own timeout ends the wait, the report says
# where they were.
_ASK_AFTER_S = 2.0
_ASK_AGAIN_S = 30.0
_KILL_AFTER_S = 10.0  # a hung rank still there this long after SIGTERM gets SIGKILL
_COLLECTIVES = os.path.join("torch", "distributed", "distributed_c10d.py")


def collective_timeout(environ: dict[str, str] | os._Environ[str]) -> float:
    """The collective timeout in seconds from :data:`TIMEOUT_VARIABLE` (default :data:`DEFAULT_TIMEOUT_S`);
    ValueError when it is not a number of seconds >= 0."""
    text = environ.get(TIMEOUT_VARIABLE, "")
    return DEFAULT_TIMEOUT_S if not text else seconds(text)


def seconds(text: str) -> float:
    """``text`` as a finite number of seconds >= 0 (ValueError naming it otherwise)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{text!r} is not a number of seconds >= 0")
    return value


def _waiting_in(frame) -> str | None:
    """``"all_reduce at train.py:12"`` when ``frame``, a thread's innermost, is in one of torch.distributed's
    collectives (with the first caller outside torch.distributed), else None."""
    if not frame.f_code.co_filename.endswith(_COLLECTIVES):
        return None
    caller = frame
    while caller is not None and f"{os.sep}torch{os.sep}distributed{os.sep}" in caller.f_code.co_filename:
        caller = caller.f_back
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "torch.distributed"
    return f"{frame.f_code.co_name} at {where}"


def raised_in_collective(error: BaseException) -> bool:
    """Whether ``error`` was raised inside one of torch.distributed's collectives (a process group's timeout)."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_COLLECTIVES):
            return True
        tb = tb.tb_next
    return False


def _stack(thread_id: int, launcher_files: tuple[str, ...]) -> str:
    """The innermost frames of the thread's stack, without the launcher's own outer ones."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "(no stack)"
    entries = traceback.extract_stack(frame, limit=_STACK_FRAMES)
    while len(entries) > 1 and entries[0].filename in launcher_files:
        entries.pop(0)
    return "".join(traceback.format_list(entries))


def _sample(connection: socket.socket, thread_id: int, launcher_files: tuple[str, ...]) -> None:
    # Holds the frame of the collective call it saw last (until the next sample, so for at most SAMPLE_S past
    # the call's end): a new call is a new frame object, which an id could not tell from one freed and reused.
    waiting = None
    while True:
        try:
            readable, _, _ = select.select([connection], [], [], SAMPLE_S)
            asked = connection.recv(4096) if readable else None
        except (OSError, ValueError):
            return
        if asked == b"":
            return  # the agent is gone
        if asked is not None and b"where" in asked:
            tell(f"stack {json.dumps(_stack(thread_id, launcher_files))}")
        frame = sys._current_frames().get(thread_id)
        where = _waiting_in(frame) if frame is not None else None
        if where is None and waiting is not None:
            waiting = None
            tell("run")
        elif where is not None and frame is not waiting:
            waiting = frame
            tell(f"wait {time.monotonic()!r} {where}")
        del frame


def sample_waits(connection: socket.socket | None, launcher_files: tuple[str, ...]) -> None:
    """(In a rank's shim) tell the clock on ``connection`` when the calling thread (the program's) waits in a
    collective, and send its stack when asked, from the first frame outside ``launcher_files`` ([Note:
    naming a hung rank])."""
    if connection is not None:
        args = (connection, threading.get_ident(), launcher_files)
        threading.Thread(target=_sample, args=args, daemon=True, name="dsfunc-waits").start()


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class HangWatch:
    """(In a node agent) stops the ranks the others have waited for longer than ``timeout_s``, and notes why
    on their :class:`~dsfunc.launcher.exits.RankState` for the failure report."""

    def __init__(self, clock: ExitClock, timeout_s: float, host: str) -> None:
        self._clock, self._timeout_s, self._host = clock, timeout_s, host
        self._acted_at = 0.0  # waits that began before the watch last acted are that hang's, not a new one
        self._asked_at = 0.0
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="dsfunc-hang-watch").start()

    def close(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self._timeout_s / 4 or 1.0)):
            live = {r: s for r, s in self._clock.ranks().items() if s.ended is None}
            waits = {r: s.waiting for r, s in live.items() if s.waiting is not None and s.waiting[0] > self._acted_at}
            if not waits:
                continue
            now, oldest = time.monotonic(), min(since for since, _ in waits.values())
            if 0 < self._timeout_s < now - oldest:
                self._stop_hung(live, waits)
                self._acted_at = time.monotonic()
            elif now - oldest > _ASK_AFTER_S and now - self._asked_at > _ASK_AGAIN_S:
                for rank in live:
                    if rank not in waits:
                        self._clock.ask_stack(rank)
                self._asked_at = now

    def _stop_hung(self, live: dict[int, RankState], waits: dict[int, tuple[float, str]]) -> None:
        now = time.monotonic()
        waited = sorted(r for r, (since, _) in waits.items() if now - since > self._timeout_s)
        first = min(waited, key=lambda r: waits[r][0])
        hung = sorted(r for r in live if r not in waits)
        if hung:
            reason = (f"it has not reached the collective {_ranks(waited)} waited in for "
                      f"{now - waits[first][0]:.0f} s ({waits[first][1]})")
        else:
            hung = sorted(live)
            reason = ("every rank here waits in a collective that the others are not in (or for ranks on "
                      "other nodes): " +
                      "; ".join(f"rank {r} in {waits[r][1]}" for r in hung))
        for rank in hung:
            self._clock.ask_stack(rank)
        deadline = time.monotonic() + _STACK_WAIT_S
        for rank in hung:
            live[rank].asked.wait(max(0.0, deadline - time.monotonic()))
        setting = f"--collective_timeout {self._timeout_s:g}; 0 turns this off"
        say(f"{_ranks(hung)} on {self._host} hung: {reason}; stopping {'it' if len(hung) == 1 else 'them'} "
            f"({setting})", "error")
        for rank in hung:
            live[rank].hung = reason
            _signal(live[rank].pid, signal.SIGTERM)
        killer = threading.Timer(_KILL_AFTER_S, _kill_survivors, args=([live[r] for r in hung],))
        killer.daemon = True
        killer.start()


def _kill_survivors(states: list[RankState]) -> None:
    for state in states:
        if state.ended is None:
            _signal(state.pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
