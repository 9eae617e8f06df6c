"""A checkpoint's files are read only as regular files inside their folder.

A name in a checkpoint (an entry of the manifest, the tag in ``latest``) must not lead a reader anywhere
else: through a symbolic link out of the folder, into a device that never ends (``/dev/zero``) or into a
FIFO that blocks the reader forever. So every file a load reads is opened here, without following a
symbolic link (``O_NOFOLLOW``) and without waiting for a writer (``O_NONBLOCK``), and refused unless
``fstat`` says it is a regular file; what is then read is bounded by the size the file has.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from dsfunc.checkpoint.errors import CheckpointCorruptError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotRegularFileError(CheckpointCorruptError):
    """A file of a checkpoint is a link, a FIFO, a device or a directory; ``what`` says which."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{path} is {what}, not a regular file: dsfunc reads a checkpoint only from regular "
                         "files inside its folder. Replace it with the file itself, or load another checkpoint")
        self.what = what


def open_regular(path: Path) -> BinaryIO:
    """``open(path, "rb")`` of a regular file; a symbolic link, FIFO, device or directory is refused
    (:class:`NotRegularFileError`) without reading from it; a missing file raises ``FileNotFoundError``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFileError(path, f"a symbolic link (to {os.readlink(path)!r})") from None
        if e.errno == errno.EISDIR:
            raise NotRegularFileError(path, "a directory") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFileError(path, next((what for test, what in _KINDS if test(mode)), "not a file"))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path``, refused when it holds more than ``limit``."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointCorruptError(f"{path} holds more than {limit:,} bytes, more than it ever holds: it was "
                                     "not written by dsfunc or DeepSpeed; remove or rewrite it")
    return data


def is_folder(path: Path) -> bool:
    """Whether ``path`` is a directory itself, not a symbolic link to one."""
    return path.is_dir() and not path.is_symlink()
