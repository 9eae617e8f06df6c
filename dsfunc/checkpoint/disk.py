"""A full disk named as such: "no space left on device while writing FILE", whatever layer hit it; a quota, a
file-size limit and a read-only file system likewise.

A save checks before writing that each rank's tensors fit in the free space of the checkpoint's
filesystem (:func:`check_space`). A disk that fills up anyway (other writers, a quota, the ranks sharing
one filesystem) fails a write part-way: with ENOSPC, EDQUOT, EFBIG or EROFS from the OS, or with torch.save's
``[enforce fail at inline_container.cc] unexpected pos ...``, which has lost the errno. Where torch.save wrote
through a Python file, the OSError is still chained behind it (``__context__``); where it wrote to a path
itself, nothing is, and the file system is asked instead: read-only (``statvfs``), nearly no space left, or
the file as large as the process's file-size limit (``RLIMIT_FSIZE``). :func:`disk_text` turns each into the
same sentence, so every rank reports the file that did not fit, the cause and what to do, instead of a
zip-writer position.
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dsfunc.checkpoint.errors import CheckpointError

_REASONS = {
    errno.ENOSPC: ("no space left on device", "free some space or save to another directory"),
    errno.EDQUOT: ("disk quota exceeded", "free some of your files, raise the quota or save elsewhere"),
    errno.EFBIG: ("file too large for this process's file-size limit (ulimit -f)",
                  "raise the limit, e.g. ulimit -f unlimited, before starting the job"),
    errno.EROFS: ("read-only file system", "remount it read-write or save to another directory"),
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
    """``"<reason> while writing FILE (<what to do>)"`` when ``error`` (or what caused it) is a full disk, a
    quota, a file-size limit or a read-only file system; None for any other error."""
    for e in _causes(error):
        if isinstance(e, OSError) and e.errno in _REASONS:
            return _text(e.errno, Path(e.filename or file))
    try:
        read_only = bool(os.statvfs(file.parent).f_flag & os.ST_RDONLY)
        free = free_bytes(file.parent)
        size = file.stat().st_size if file.is_file() else 0
    except OSError:
        return None
    if read_only:
        return _text(errno.EROFS, file)
    if free < FULL_BELOW_BYTES:
        reason, advice = _REASONS[errno.ENOSPC]
        return (f"{reason} while writing {file} ({free:,} bytes free; {type(error).__name__}: {error}; "
                f"{advice})")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and size >= limit:
        return _text(errno.EFBIG, file, f"{file.name} stopped at the limit of {limit:,} bytes")
    return None


def _text(code: int, file: Path, found: str = "") -> str:
    reason, advice = _REASONS[code]
    return f"{reason} while writing {file} ({found + '; ' if found else ''}{advice})"


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the chain of exceptions behind it."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
