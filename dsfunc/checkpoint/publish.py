"""Writing a checkpoint so that it appears whole or not at all, and a crash mid-save loses nothing.

[Note: publishing a checkpoint]
Ranks write into ``save_dir/.<tag>.tmp-<id>``. Once every rank's files are on disk and checksummed, rank 0
writes ``client_state.pt``, then ``dsfunc_checkpoint.json`` last (its presence is what makes a folder a
checkpoint), fsyncs the folder, and renames it to ``<tag>``. An existing ``<tag>`` is first renamed to
``.<tag>.replaced`` and removed only after the new one is in place, so a crash between the two renames
leaves the complete old checkpoint under ``.<tag>.replaced``: loads find it there
(:func:`~dsfunc.checkpoint.tags.find_checkpoint`) and the next save moves it back (:func:`_recover`).
Only then is ``latest`` replaced (write + fsync + ``os.replace``). A save that dies part-way leaves the
previous checkpoint and ``latest`` as they were.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from dsfunc.checkpoint import layout
from dsfunc.checkpoint.coordination import collective
from dsfunc.checkpoint.dcp_io import failure_text, write_failure_text, write_tensors
from dsfunc.checkpoint.disk import check_space, disk_text, local_bytes
from dsfunc.checkpoint.errors import CheckpointError
from dsfunc.checkpoint.layout import CLIENT_FILE, LATEST_FILE, META_FILE, tensor_file
from dsfunc.checkpoint.metadata import digest, hash_share
from dsfunc.checkpoint.recovery import write_recovery_script
from dsfunc.checkpoint.tags import read_latest
from dsfunc.distributed import comm


def write_checkpoint(save_dir: Path, tag: str, tensors: dict[str, Any], meta: dict[str, Any],
                     client: bytes | None, save_latest: bool) -> str:
    """Write, verify and publish one checkpoint (runs on every rank, maybe in the save thread)."""
    rank, tmp = comm.rank(), None
    try:
        tmp = Path(collective(lambda: _make_tmp(save_dir, tag) if rank == 0 else None, src=0))
        collective(lambda: check_space(tmp, tmp / tensor_file(rank), local_bytes(tensors)))
        try:
            write_tensors(tensors, tmp)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"writing the tensors failed: {write_failure_text(e, tmp)}") from e
        digests: dict[str, Any] = {}
        for part in collective(lambda: hash_share(tmp), gather=True):
            digests.update(part)
        collective(lambda: _publish(save_dir, tmp, tag, {**meta, "files": digests}, client, save_latest)
                   if rank == 0 else None)
    except Exception as e:
        if rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = read_latest(save_dir)
        kept = f"`latest` still names {latest!r}" if latest else "no `latest` was written"
        cause = str(e) if isinstance(e, CheckpointError) else failure_text(e)
        cls = type(e) if isinstance(e, CheckpointError) else CheckpointError
        raise cls(f"saving checkpoint {tag!r} to {save_dir} failed: {cause}. Nothing was replaced: {kept}, "
                  "and earlier checkpoints are intact.") from e
    return str(save_dir / tag)


def _make_tmp(save_dir: Path, tag: str) -> str:
    """(rank 0) Create the folder the ranks write into, after tidying what crashed saves left behind."""
    tmp = layout.temporary(save_dir, tag)
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        for old in layout.replaced_tags(save_dir):
            _recover(save_dir, old)
        for stale in layout.temporaries(save_dir):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        text = disk_text(e, tmp)
        if text is None:
            raise
        raise CheckpointError(text) from e
    return str(tmp)


def _recover(save_dir: Path, tag: str) -> None:
    """Undo a save of ``tag`` that died between moving the old folder aside and moving the new one in."""
    old, final = layout.replaced(save_dir, tag), save_dir / tag
    if (final / META_FILE).is_file() or not (old / META_FILE).is_file():
        shutil.rmtree(old)
        return
    if final.exists():
        shutil.rmtree(final)
    os.rename(old, final)


def _publish(save_dir: Path, tmp: Path, tag: str, meta: dict[str, Any], client: bytes | None,
             save_latest: bool) -> None:
    """(rank 0) Complete the folder, move it into place, then point ``latest`` at it.

    The order is that of [Note: publishing a checkpoint].
    """
    if client is not None:
        _write_durably(tmp / CLIENT_FILE, client)
        meta["files"][CLIENT_FILE] = digest(tmp / CLIENT_FILE)
    _write_durably(tmp / META_FILE, json.dumps(meta, indent=1).encode())  # last: marks the folder complete
    _fsync_dir(tmp)
    final = save_dir / tag
    if final.exists():
        old = layout.replaced(save_dir, tag)
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(save_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(save_dir)
    if save_latest:
        pending = layout.temporary(save_dir, LATEST_FILE)
        _write_durably(pending, tag.encode())
        os.replace(pending, save_dir / LATEST_FILE)
        _fsync_dir(save_dir)
    if meta["zero_stage"] > 0:  # as DeepSpeed's ZeRO saves do
        write_recovery_script(save_dir)


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and wait until it is on disk; a full disk is named as such."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        text = disk_text(e, path)
        if text is None:
            raise
        raise CheckpointError(text) from e


def _fsync_dir(path: Path) -> None:
    """Wait until the names in the folder ``path`` (files created, renamed) are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(out: str | os.PathLike) -> Iterator[Path]:
    """A temporary path next to ``out`` to write into; when the block succeeds it is fsynced and renamed to
    ``out``, and in any case it is gone afterwards: ``out`` is never seen half-written."""
    tmp = Path(f"{out}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
