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
report, with the code its program said it exited with (the agent's SIGTERM may end its shutdown).
"""

from __future__ import annotations

import math
import os
import selectors
import shutil
import socket
import struct
import tempfile
import threading
import time

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


def report_start(rank: str) -> None:
    """(In a rank's shim) connect to the node agent's clock, if it has one, and say which rank this is."""
    global _CONNECTION
    path = os.environ.pop(CLOCK_VARIABLE, None)
    if not path:
        return
    try:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(path)
        connection.sendall(f"{rank}\n".encode())
        _CONNECTION = connection
    except OSError:
        pass  # the clock only orders failure reports: a rank never fails for want of it


def report_exit(code: int) -> None:
    """(In a rank's shim) the user's program has ended with exit code ``code``: tell the clock before the
    interpreter shuts down (the agent may stop this process with SIGTERM while it does)."""
    if _CONNECTION is not None:
        try:
            _CONNECTION.sendall(f"exit {code} {time.monotonic()!r}\n".encode())
        except OSError:
            pass


def exit_code(error: BaseException | None) -> int:
    """The exit code a program that ended with ``error`` (None: it returned) leaves with, as Python's."""
    if error is None:
        return 0
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else 0 if error.code is None else 1
    return 130 if isinstance(error, KeyboardInterrupt) else 1


class ExitClock:
    """Notes when each reporting rank ends (``time.monotonic()``, [Note: which rank failed first])."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="dsfunc-exits-")
        self.path = os.path.join(self._dir, "clock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(1024)
        self._ended: dict[int, float] = {}
        self._codes: dict[int, int] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ, None)
        self._closed = False
        threading.Thread(target=self._serve, daemon=True, name="dsfunc-exit-clock").start()

    def ended(self, rank: int) -> float | None:
        """When ``rank``'s latest process ended (or said it was ending), or None."""
        return self._ended.get(rank)

    def code(self, rank: int) -> int | None:
        """The exit code ``rank``'s program said it ended with, or None (it did not say: killed, or exec'd)."""
        return self._codes.get(rank)

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
                    self._died(key.fileobj, key.data[1], time.monotonic())
            for key, _ in events:
                if key.fileobj is not self._server and key.data[0] == "connection":
                    self._message(key.fileobj, key.data[1])

    def _message(self, conn: socket.socket, rank: int) -> None:
        """``exit CODE TIME`` from a rank whose program just ended (TIME: its ``time.monotonic()``, the same
        clock as ours on one machine), or the end of its connection."""
        data = _read(conn)
        if data == b"":
            self._forget(conn)
            return
        if data is None or not data.startswith(b"exit "):
            return
        _, code, at = data.split()[:3]
        self._codes[rank] = int(code)
        self._ended[rank] = min(self._ended.get(rank, math.inf), float(at))

    def _died(self, pidfd: int, rank: int, now: float) -> None:
        """``rank``'s process is gone; its end counts :data:`ABRUPT_LEAD_S` earlier (see there)."""
        self._ended[rank] = min(self._ended.get(rank, math.inf), now - ABRUPT_LEAD_S)
        self._forget(pidfd)

    def _accept(self) -> None:
        """Read a starting rank's number; watch its connection and its process."""
        try:
            conn, _ = self._server.accept()
            conn.settimeout(5)
            rank = int(conn.recv(64).split(b"\n")[0])
            pid, _, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            pidfd = os.pidfd_open(pid)
        except (OSError, ValueError):
            return
        conn.setblocking(False)
        self._ended.pop(rank, None)  # a restarted rank: its earlier process's end no longer counts
        self._codes.pop(rank, None)
        self._selector.register(conn, selectors.EVENT_READ, ("connection", rank))
        self._selector.register(pidfd, selectors.EVENT_READ, ("pidfd", rank))

    def _forget(self, fileobj: socket.socket | int) -> None:
        self._selector.unregister(fileobj)
        if isinstance(fileobj, int):
            os.close(fileobj)
        else:
            fileobj.close()


def _read(conn: socket.socket) -> bytes | None:
    """What the rank sent (``b""`` once its connection closed), or None when nothing is there after all."""
    try:
        return conn.recv(64)
    except BlockingIOError:
        return None
    except OSError:
        return b""
