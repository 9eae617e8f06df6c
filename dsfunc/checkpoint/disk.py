"""A full disk named as such: "no space left on device while writing FILE", whatever layer hit it.

A save checks before writing that each rank's tensors fit in the free space of the checkpoint's
filesystem (:func:`check_space`). A disk that fills up anyway (other writers, a quota, the ranks sharing
one filesystem) fails a write part-way: with ENOSPC, EDQUOT or EFBIG from the OS, or with torch.save's
``[enforce fail at inline_container.cc] unexpected pos ...``, which has lost the errno. :func:`disk_text`
turns either into the same sentence (judging the second by the free space left), so every rank reports
the file that did not fit instead of a zip-writer position.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dsfunc.checkpoint.errors import CheckpointError

_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for this process's file-size limit (ulimit -f)",
}
# After a write failed without an errno, this little free space left means the disk was full.
FULL_BELOW_BYTES = 1 << 20


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def local_bytes(tensors: dict[str, Any]) -> int:
    """The tensor bytes this rank writes of ``tensors`` (its local shard of every DTensor)."""
    total = 0
    for t in tensors.values():
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def check_space(folder: Path, file: Path, needed: int) -> None:
    """Raise before writing when ``needed`` bytes of ``file`` are more than the free space of ``folder``."""
    free = free_bytes(folder)
    if needed > free:
        raise CheckpointError(
            f"no space left on device while writing {file}: it needs {needed:,} bytes and the filesystem "
            f"has {free:,} free (free some space or save to another directory)"
        )


def disk_text(error: BaseException, file: Path) -> str | None:
    """``"<reason> while writing FILE"`` when ``error`` (or what caused it) is a full disk, a quota or a
    file-size limit; None for any other error."""
    for e in _causes(error):
        if isinstance(e, OSError) and e.errno in _REASONS:
            return f"{_REASONS[e.errno]} while writing {e.filename or file}"
    try:
        free = free_bytes(file.parent)
    except OSError:
        return None
    if free < FULL_BELOW_BYTES:
        return f"no space left on device while writing {file} ({free:,} bytes free; {type(error).__name__}: {error})"
    return None


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the chain of exceptions behind it."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
