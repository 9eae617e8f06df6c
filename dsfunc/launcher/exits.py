"""When each rank's process ended, as its node's agent saw it: the rank that failed first is the cause.

[Note: which rank failed first]
When one rank dies, the others fail in turn: a rank waiting in a collective raises a gloo error, or torch
elastic's agent stops it with SIGTERM. The agent polls its ranks only every monitor interval and keeps
whole-second timestamps (from the rank's error file, or the time it noticed), so a rank that exits 1
without a traceback and the rank whose collective broke because of it look alike; by error files alone
the second, which has a traceback, even looks first. Nor does the order in which the processes end
decide it: a rank leaving with ``sys.exit(1)`` closes its gloo sockets while the interpreter shuts down,
and the rank waiting on them can raise and be gone before that shutdown is over.

So each rank's shim connects to an :class:`ExitClock` of its node agent when it starts (its pid comes
with the connection) and says ``exit CODE TIME`` the moment the user's program ends, before the
interpreter shuts down (an exception, ``sys.exit``, returning; TIME is its ``time.monotonic()``, one clock
for the whole machine). The clock also watches the process through a pidfd, which becomes readable when
the process is gone however it ended (``os._exit``, a signal, ``exec``'d programs; not delayed by
children it forked, such as data-loader workers); such a death counts :data:`ABRUPT_LEAD_S` earlier than
seen. A rank's end is the earlier of the two; the earliest end among the failed ranks is the failure to
report, with the code its program said it exited with (the agent's SIGTERM may end its shutdown). A rank
whose program ended with code 0 has not failed, even when the agent then stopped its shutdown: a rank that
failed after it is the cause, and a rank that ended with code 0 while the others still ran is reported as
having left early (their collectives break when it goes).

The same connection carries where each rank waits (:mod:`dsfunc.launcher.hangs`): ``wait TIME WHERE`` when
its main thread is found blocked in a collective, ``run`` when it is out again, and, asked ``where``, its
main thread's stack as ``stack JSON``.

[Note: a wait that ends in an error]
A collective that times out raises, and the program ends with that error. The sampler, looking every
:data:`~dsfunc.launcher.hangs.SAMPLE_S`, may see the thread out of the collective before the shim says
``exit``: it says ``run``, and the clock would forget the wait the failure came from. So the shim says
``exit CODE TIME collective`` when the error was raised inside a collective, and the clock takes back the wait
that ``run`` ended: the rank ended in it.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field

#: The variable through which the node agent tells its ranks' shims where the clock listens.
CLOCK_VARIABLE = "DSFUNC_EXIT_CLOCK"
_UCRED = struct.Struct("3i")  # SO_PEERCRED's struct ucred: pid, uid, gid
# A process that dies without its program ending (os._exit, a signal) closes its sockets while the kernel
# tears it down, microseconds before its pidfd reports it gone: a peer blocked on such a socket can raise,
# and say so, just before the clock sees the death (measured: 0.6 ms after, but either way round). So a
# death the clock learns only from the pidfd counts this much earlier than seen: a failure reported less
# than 50 ms before it is taken for its consequence.
ABRUPT_LEAD_S = 0.05


_CONNECTION: socket.socket | None = None  # (in a rank) open until the process ends
_SENDING = threading.Lock()  # (in a rank) the program's thread and the hang sampler's both send


def report_start(rank: str) -> socket.socket | None:
    """(In a rank's shim) connect to the node agent's clock, if it has one, and say which rank this is;
    returns the connection (None without a clock)."""
    global _CONNECTION
    path = os.environ.pop(CLOCK_VARIABLE, None)
    if not path:
        return None
    try:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(path)
        connection.sendall(f"{rank}\n".encode())
    except OSError:
        return None  # the clock only orders failure reports: a rank never fails for want of it
    _CONNECTION = connection
    return connection


def tell(line: str) -> None:
    """(In a rank) send one line to the clock, if connected (from any thread)."""
    if _CONNECTION is None:
        return
    with _SENDING:
        try:
            _CONNECTION.sendall(f"{line}\n".encode())
        except OSError:
            pass


def report_exit(code: int, in_collective: bool = False) -> None:
    """(In a rank's shim) the user's program has ended with exit code ``code`` (``in_collective``: by an error
    raised in a collective it waited in): tell the clock before the interpreter shuts down (the agent may stop
    this process with SIGTERM while it does)."""
    tell(f"exit {code} {time.monotonic()!r}" + (" collective" if in_collective else ""))


def exit_code(error: BaseException | None) -> int:
    """The exit code a program that ended with ``error`` (None: it returned) leaves with, as Python's."""
    if error is None:
        return 0
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else 0 if error.code is None else 1
    return 130 if isinstance(error, KeyboardInterrupt) else 1


@dataclass
class _Peer:
    """One rank's connection, as the clock reads it."""

    conn: socket.socket
    pid: int
    pidfd: int
    rank: int | None = None  # its first line
    buffer: bytes = b""


@dataclass
class RankState:
    """What the clock knows of a rank's latest process."""

    pid: int
    ended: float | None = None  # when it ended or said it was ending (time.monotonic())
    code: int | None = None  # the exit code its program said it ended with
    waiting: tuple[float, str] | None = None  # (since, where) while blocked in a collective, or when it ended
    left: tuple[float, str] | None = None  # the collective it was last seen out of again
    stack: tuple[float, str] | None = None  # (when, its main thread's stack) when last asked
    hung: str | None = None  # why dsfunc stopped it as hung (dsfunc.launcher.hangs)
    asked: threading.Event = field(default_factory=threading.Event)  # set when a stack arrives


class ExitClock:
    """Notes when each reporting rank ends (``time.monotonic()``, [Note: which rank failed first]) and
    where it waits."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="dsfunc-exits-")
        self.path = os.path.join(self._dir, "clock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(1024)
        self._ranks: dict[int, RankState] = {}
        self._peer_of: dict[int, _Peer] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ, None)
        self._closed = False
        threading.Thread(target=self._serve, daemon=True, name="dsfunc-exit-clock").start()

    def ended(self, rank: int) -> float | None:
        """When ``rank``'s latest process ended (or said it was ending), or None."""
        state = self._ranks.get(rank)
        return None if state is None else state.ended

    def code(self, rank: int) -> int | None:
        """The exit code ``rank``'s program said it ended with, or None (it did not say: killed, or exec'd)."""
        state = self._ranks.get(rank)
        return None if state is None else state.code

    def ranks(self) -> dict[int, RankState]:
        """Every rank that reported, by global rank (a snapshot)."""
        return dict(self._ranks)

    def ask_stack(self, rank: int) -> None:
        """Ask ``rank`` for its main thread's stack; :attr:`RankState.asked` is set when it arrives."""
        state, peer = self._ranks.get(rank), self._peer_of.get(rank)
        if state is None or peer is None:
            return
        state.asked.clear()
        try:
            peer.conn.sendall(b"where\n")
        except OSError:
            state.asked.set()

    def close(self) -> None:
        self._closed = True
        self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        while not self._closed:
            try:
                events = self._selector.select(timeout=0.5)
            except (OSError, ValueError):
                return
            for key, _ in events:  # pidfds first: a death seen together with a message came before it
                if key.fileobj is self._server:
                    self._accept()
                elif key.data[0] == "pidfd":
                    self._died(key.data[1], time.monotonic())
            for key, _ in events:
                if key.fileobj is not self._server and key.data[0] == "connection":
                    self._receive(key.data[1])

    def _receive(self, peer: _Peer) -> None:
        """Lines from a rank: its number, then ``exit CODE TIME`` (TIME: its ``time.monotonic()``, the same
        clock as ours on one machine), ``wait TIME WHERE``, ``run``, ``stack JSON``; or its connection's end."""
        data = _read(peer.conn)
        if data == b"":
            self._forget(peer.conn)
            return
        *lines, peer.buffer = (peer.buffer + (data or b"")).split(b"\n")
        for line in lines:
            try:
                self._line(peer, line.decode(errors="replace"))
            except ValueError:  # not a line a shim sends: nothing to learn from it
                continue

    def _line(self, peer: _Peer, line: str) -> None:
        if peer.rank is None:
            if not line.strip().isdigit():
                self._forget(peer.conn)
                return
            peer.rank = int(line)
            self._ranks[peer.rank] = RankState(peer.pid)  # a restarted rank: its earlier process no longer counts
            self._peer_of[peer.rank] = peer
            self._selector.register(peer.pidfd, selectors.EVENT_READ, ("pidfd", peer))
            return
        if self._peer_of.get(peer.rank) is not peer:
            return  # an earlier process of a rank that has started again
        state = self._ranks[peer.rank]
        kind, _, rest = line.partition(" ")
        if kind == "exit":
            code, at, *how = rest.split()
            state.code = int(code)
            state.ended = _earlier(state.ended, float(at))
            if how == ["collective"] and state.waiting is None:
                state.waiting = state.left  # [Note: a wait that ends in an error]
        elif kind == "wait":
            since, _, where = rest.partition(" ")
            state.waiting = (float(since), where)
        elif kind == "run":
            state.left, state.waiting = state.waiting, None
        elif kind == "stack":
            state.stack = (time.monotonic(), json.loads(rest))
            state.asked.set()

    def _died(self, peer: _Peer, now: float) -> None:
        """``peer``'s process is gone; its end counts :data:`ABRUPT_LEAD_S` earlier (see there), unless its rank
        has started again since."""
        if self._peer_of.get(peer.rank) is peer:
            state = self._ranks[peer.rank]
            state.ended = _earlier(state.ended, now - ABRUPT_LEAD_S)
            state.asked.set()
        self._forget(peer.pidfd)

    def _accept(self) -> None:
        """Watch a starting rank's connection (its first line is its number) and, once it is known, its process."""
        try:
            conn, _ = self._server.accept()
            pid, _, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            pidfd = os.pidfd_open(pid)
        except OSError:
            return
        conn.setblocking(False)
        peer = _Peer(conn, pid, pidfd)
        self._selector.register(conn, selectors.EVENT_READ, ("connection", peer))

    def _forget(self, fileobj: socket.socket | int) -> None:
        try:
            key = self._selector.unregister(fileobj)
        except (KeyError, ValueError):
            return
        if isinstance(fileobj, int):
            os.close(fileobj)
            return
        fileobj.close()
        peer = key.data[1]
        if peer.rank is None:
            os.close(peer.pidfd)


def _earlier(ended: float | None, at: float) -> float:
    return at if ended is None else min(ended, at)


def _read(conn: socket.socket) -> bytes | None:
    """What the rank sent (``b""`` once its connection closed), or None when nothing is there after all."""
    try:
        return conn.recv(65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""
