"""Writing a checkpoint so that it appears whole or not at all, and a crash mid-save loses nothing.

[Note: publishing a checkpoint]
Ranks write into ``save_dir/.<tag>.tmp-<id>``, a folder of this save alone. Once every rank's files are on
disk and checksummed, rank 0 writes ``client_state.pt``, then ``dsfunc_checkpoint.json`` last (its presence
is what makes a folder a checkpoint), fsyncs the folder, and renames it to ``<tag>``. An existing ``<tag>``
is first renamed to ``.<tag>.replaced`` and removed only after the new one is in place, so a crash between
the two renames leaves the complete old checkpoint under ``.<tag>.replaced``: loads find it there
(:func:`~dsfunc.checkpoint.tags.find_checkpoint`) and the next save moves it back (:func:`_recover`).
Only then is ``latest`` replaced (write + fsync + ``os.replace``). A save that dies part-way leaves the
previous checkpoint and ``latest`` as they were. Several jobs may save into one ``save_dir``: the renames
run one job at a time, and a save tidies away only what dead saves left ([Note: jobs sharing a save_dir]
in :mod:`.locks`). Names in ``save_dir`` are renamed or removed, never followed: a symbolic link named
like a tag is replaced by the checkpoint, and what it points to is left alone.
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

from dsfunc.checkpoint import locks, paths
from dsfunc.checkpoint.coordination import collective
from dsfunc.checkpoint.dcp_io import failure_text, write_failure_text, write_tensors
from dsfunc.checkpoint.disk import check_space, disk_text, local_bytes
from dsfunc.checkpoint.errors import CheckpointError
from dsfunc.checkpoint.files import is_folder
from dsfunc.checkpoint.metadata import digest, hash_share
from dsfunc.checkpoint.paths import CLIENT_FILE, LATEST_FILE, META_FILE, OWNER_FILE, tensor_file
from dsfunc.checkpoint.recovery import write_recovery_script
from dsfunc.checkpoint.tags import read_latest
from dsfunc.distributed import comm


def write_checkpoint(save_dir: Path, tag: str, tensors: dict[str, Any], meta: dict[str, Any],
                     client: bytes | None, save_latest: bool, timeout: float) -> str:
    """Write, verify and publish one checkpoint (runs on every rank, maybe in the save thread); ``timeout``
    bounds the wait for another job's save into ``save_dir`` ([Note: jobs sharing a save_dir])."""
    rank = comm.rank()
    with contextlib.ExitStack() as claimed:  # rank 0's claim on the temporary folder, and its removal
        try:
            tmp = Path(collective(lambda: str(claimed.enter_context(_temporary(save_dir, tag, timeout)))
                                  if rank == 0 else None, src=0))
            collective(lambda: check_space(tmp, tmp / tensor_file(rank), local_bytes(tensors)))
            try:
                write_tensors(tensors, tmp)
            except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
                raise CheckpointError(f"writing the tensors failed: {write_failure_text(e, tmp)}") from e
            digests: dict[str, Any] = {}
            for part in collective(lambda: hash_share(tmp), gather=True):
                digests.update(part)
            collective(lambda: _publish(save_dir, tmp, tag, {**meta, "files": digests}, client, timeout)
                       if rank == 0 else None)
        except Exception as e:
            raise _error(e)(f"saving checkpoint {tag!r} to {save_dir} failed: {_cause(e)}. Nothing was "
                            f"replaced: {_latest_now(save_dir)}, and earlier checkpoints are intact.") from e
    try:
        collective(lambda: _settle(save_dir, tag, save_latest, timeout) if rank == 0 else None)
    except Exception as e:
        raise _error(e)(f"checkpoint {tag!r} was saved to {save_dir / tag} and is complete, but "
                        f"{'`latest` was not updated' if save_latest else 'tidying up after it failed'}: "
                        f"{_cause(e)}; {_latest_now(save_dir)}. Load the new checkpoint with tag={tag!r}."
                        ) from e
    return str(save_dir / tag)


def _cause(e: Exception) -> str:
    return str(e) if isinstance(e, CheckpointError) else failure_text(e)


def _error(e: Exception) -> type[CheckpointError]:
    return type(e) if isinstance(e, CheckpointError) else CheckpointError


def _latest_now(save_dir: Path) -> str:
    """What ``latest`` names now, as the end of an error message says it."""
    try:
        latest = read_latest(save_dir)
    except CheckpointError as e:
        return f"`latest` cannot be read ({e})"
    return f"`latest` still names {latest!r}" if latest else "no `latest` was written"


@contextlib.contextmanager
def _temporary(save_dir: Path, tag: str, timeout: float) -> Iterator[Path]:
    """(rank 0) The folder the ranks write into, claimed by this process while the block runs and removed
    after it unless it was published; made after tidying what dead saves left behind."""
    tmp = paths.temporary(save_dir, tag)
    with contextlib.ExitStack() as stack:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            with locks.hold(save_dir, timeout):
                _tidy(save_dir)
                _check_replaceable(save_dir / tag)
                tmp.mkdir()
                stack.callback(_remove, tmp)  # runs before the claim is released
                stack.enter_context(locks.claim(tmp))
        except OSError as e:
            text = disk_text(e, tmp)
            if text is None:
                raise
            raise CheckpointError(text) from e
        yield tmp


def _tidy(save_dir: Path) -> None:
    """(under the lock of ``save_dir``) Put back what saves that died between their renames moved aside, and
    remove the temporary folders of saves that died and ``latest`` files never moved into place."""
    for old in paths.replaced_tags(save_dir):
        _recover(save_dir, old)
    for stale in paths.temporaries(save_dir):
        if not is_folder(stale) or locks.abandoned(stale):
            _remove(stale)


def _check_replaceable(final: Path) -> None:
    """Refuse a tag whose name in ``save_dir`` holds a file of the user's, which publishing would remove."""
    if os.path.lexists(final) and not final.is_symlink() and not final.is_dir():
        raise CheckpointError(f"{final} is a file, not a checkpoint folder: remove or rename it, or save "
                              "under another tag")


def _recover(save_dir: Path, tag: str) -> None:
    """Undo a save of ``tag`` that died between moving the old folder aside and moving the new one in."""
    old, final = paths.replaced(save_dir, tag), save_dir / tag
    if _complete(final) or not _complete(old):
        _remove(old)
        return
    _remove(final)
    os.rename(old, final)


def _complete(folder: Path) -> bool:
    return is_folder(folder) and (folder / META_FILE).is_file()


def _remove(path: Path) -> None:
    """Remove ``path`` if it is there: a folder with what it holds, a file or a link (never what it points to)."""
    if is_folder(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _publish(save_dir: Path, tmp: Path, tag: str, meta: dict[str, Any], client: bytes | None,
             timeout: float) -> None:
    """(rank 0) Complete the folder and move it into place, in the order of [Note: publishing a checkpoint]."""
    if client is not None:
        _write_durably(tmp / CLIENT_FILE, client)
        meta["files"][CLIENT_FILE] = digest(tmp / CLIENT_FILE)
    _write_durably(tmp / META_FILE, json.dumps(meta, indent=1).encode())  # last: marks the folder complete
    _fsync_dir(tmp)
    final = save_dir / tag
    with locks.hold(save_dir, timeout):
        _check_replaceable(final)
        (tmp / OWNER_FILE).unlink()  # the lock protects the folder until it has its final name
        if os.path.lexists(final):
            old = paths.replaced(save_dir, tag)
            _remove(old)
            os.rename(final, old)
        os.rename(tmp, final)
        if meta["zero_stage"] > 0:  # as DeepSpeed's ZeRO saves do
            write_recovery_script(save_dir)


def _settle(save_dir: Path, tag: str, save_latest: bool, timeout: float) -> None:
    """(rank 0) After ``tag`` is in place: remove what it replaced, and point ``latest`` at it."""
    with locks.hold(save_dir, timeout):
        _fsync_dir(save_dir)
        _remove(paths.replaced(save_dir, tag))
        if not save_latest:
            return
        temporary = paths.temporary(save_dir, LATEST_FILE)
        try:
            _write_durably(temporary, tag.encode())
            os.replace(temporary, save_dir / LATEST_FILE)
        finally:
            temporary.unlink(missing_ok=True)
        _fsync_dir(save_dir)


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
