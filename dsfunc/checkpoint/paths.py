"""The names of everything a save puts in ``save_dir``, every rank writing its file::

    save_dir/latest                          the newest tag (text, no newline), replaced atomically
    save_dir/<tag>/.metadata                 torch.distributed.checkpoint's index of the tensors
    save_dir/<tag>/__<r>_0.distcp            tensor data written by rank r
    save_dir/<tag>/client_state.pt           rank 0's ``client_state`` (torch.save pickle)
    save_dir/<tag>/dsfunc_checkpoint.json    what was saved, with every file's size and sha256
    save_dir/.<tag>.tmp-<id>/                a save in progress, or one that died: never loaded
    save_dir/.<tag>.tmp-<id>/.owner          locked by the save's rank 0 while it runs (:mod:`.locks`)
    save_dir/.<tag>.replaced/                the previous ``<tag>`` while a save over it moves the new one in
    save_dir/.latest.tmp-<id>                the next ``latest`` while it is written
    save_dir/.lock                           locked while a save changes the names in save_dir

A folder is a complete checkpoint exactly when it holds ``dsfunc_checkpoint.json``, which is written last.
Several jobs may save into one ``save_dir`` ([Note: jobs sharing a save_dir] in :mod:`.locks`).
"""

from __future__ import annotations

import uuid
from pathlib import Path

META_FILE = "dsfunc_checkpoint.json"
CLIENT_FILE = "client_state.pt"
LATEST_FILE = "latest"
META_DATA = ".metadata"  # DCP's index, written by rank 0 (a pickle)
LOCK_FILE = ".lock"
OWNER_FILE = ".owner"
_REPLACED = ".replaced"


def tensor_file(rank: int) -> str:
    """The name of the file of tensor data that ``rank`` writes (DCP's, with one file per rank)."""
    return f"__{rank}_0.distcp"


def temporary(save_dir: Path, name: str) -> Path:
    """A fresh hidden name in ``save_dir`` to write ``name`` (a tag, or ``latest``) under until it is complete."""
    return save_dir / f".{name}.tmp-{uuid.uuid4().hex[:12]}"


def temporaries(save_dir: Path) -> list[Path]:
    """What :func:`temporary` names are in ``save_dir``: saves in progress, or left by saves that died."""
    return list(save_dir.glob(".*.tmp-*"))


def replaced(save_dir: Path, tag: str) -> Path:
    """Where the previous ``<tag>`` is kept while a save over it moves the new one in."""
    return save_dir / f".{tag}{_REPLACED}"


def replaced_tags(save_dir: Path) -> list[str]:
    """Tags whose :func:`replaced` folder is in ``save_dir``: saves over them that died between the renames."""
    return [p.name[1 : -len(_REPLACED)] for p in save_dir.glob(f".*{_REPLACED}")]
