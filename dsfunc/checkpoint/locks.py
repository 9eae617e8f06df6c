"""Several jobs saving into one ``save_dir``: which save may change what, by locks the OS releases when
their holder dies.

[Note: jobs sharing a save_dir]
Two jobs may save into one ``save_dir`` at once (a restarted job overlapping its predecessor, an evaluation
job saving next to the training job). Each save writes into a temporary folder of its own, which its rank 0
claims by holding a lock on the file ``.owner`` inside it (:func:`claim`) until the folder is published or
removed. Every step that changes the names in ``save_dir`` (tidying what dead saves left, creating a
temporary folder, the renames that publish a tag, replacing ``latest``) runs under the lock on
``save_dir/.lock`` (:func:`hold`), one job at a time. Tidying removes a temporary folder only when its claim
can be taken (:func:`abandoned`): its owner died, and the OS released the lock with it. So no save removes
another job's save in progress, and two jobs publishing the same tag one after the other leave the later
one's checkpoint, complete. Locks are ``flock`` locks, which local file systems and NFS (as locks on the
server) both keep; on a file system that keeps none (Lustre mounted without ``flock``) saves go on unlocked,
as one job per ``save_dir``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dsfunc.checkpoint.errors import CheckpointTimeoutError
from dsfunc.checkpoint.paths import LOCK_FILE, OWNER_FILE


@contextlib.contextmanager
def hold(save_dir: Path, timeout: float) -> Iterator[None]:
    """Hold the lock of ``save_dir``, waiting up to ``timeout`` seconds for the job that holds it."""
    path = save_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:  # a read-only file system: the lock still orders the saves that then fail to write
        if e.errno != errno.EROFS:
            raise
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        deadline, pause = time.monotonic() + timeout, 0.001
        while True:
            try:
                _lock(fd)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 200, 0).decode(errors="replace") or "a process"
                    raise CheckpointTimeoutError(
                        f"{holder} has held {path} for over {timeout:g} s: another job is saving into the "
                        "same save_dir and is stopped or very slow. Let it finish, save elsewhere, or pass a "
                        "larger timeout=") from None
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
        with contextlib.suppress(OSError):  # who holds it, for the message above (not on a read-only disk)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        _release(fd)


@contextlib.contextmanager
def claim(folder: Path) -> Iterator[None]:
    """Mark the new folder ``folder`` as this process's while the block runs (create it under :func:`hold`)."""
    fd = os.open(folder / OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        _lock(fd)
        yield
    finally:
        _release(fd)


def abandoned(folder: Path) -> bool:
    """Whether no live process claims ``folder`` (ask under :func:`hold`, where no claim is being made)."""
    try:
        fd = os.open(folder / OWNER_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # no claim (it died before claiming, or an older dsfunc made it), or a link: no lock
        return e.errno in (errno.ENOENT, errno.ELOOP)
    try:
        _lock(fd)
    except BlockingIOError:
        os.close(fd)
        return False
    _release(fd)
    return True


def _lock(fd: int) -> None:
    """Lock ``fd`` now, or raise ``BlockingIOError`` where another holds the lock; where the file system
    keeps no locks, go on without."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise


def _release(fd: int) -> None:
    """Unlock explicitly, then close: a process forked meanwhile shares the open file, and would keep the
    lock held after a plain close."""
    try:
        with contextlib.suppress(OSError):  # nothing to unlock where the file system keeps no locks
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
