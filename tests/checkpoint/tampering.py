"""Tampering with a saved checkpoint as an attacker would: a file rewritten with a pickle that runs code,
and (for dsfunc) the manifest rewritten to match, so that only the restricted readers stand in the way."""

from __future__ import annotations

import io
import json
import os
import pickle
import shlex
from pathlib import Path
from typing import Any

import torch

from dsfunc.checkpoint.layout import META_FILE
from dsfunc.checkpoint.metadata import digest


class Payload:
    """Unpickling this runs a shell command that creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def torch_saved(obj: Any) -> bytes:
    """The bytes ``torch.save(obj)`` writes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def rewrite(path: Path, data: bytes, *, manifest: bool = True) -> None:
    """Replace ``path`` with ``data``; with ``manifest``, record its new size and sha256 in the dsfunc
    metadata file next to it, as whoever can write the files can."""
    path.write_bytes(data)
    if manifest:
        meta_file = path.parent / META_FILE
        meta = json.loads(meta_file.read_text())
        meta["files"][path.name] = digest(path)
        meta_file.write_text(json.dumps(meta))


def read_index(folder: Path) -> Any:
    """DCP's index of ``folder``, fully unpickled (the test's own trusted checkpoint)."""
    return pickle.loads((folder / ".metadata").read_bytes())


def write_index(folder: Path, index: Any) -> None:
    """Write ``index`` as DCP's ``.metadata`` (``pickle.dump``, as DCP does), and record it in the manifest."""
    rewrite(folder / ".metadata", pickle.dumps(index))


def append_record(folder: Path, file: str, data: bytes) -> tuple[int, int]:
    """Append ``data`` to the data file ``file`` of ``folder`` (manifest updated); its ``(offset, length)``."""
    path = folder / file
    old = path.read_bytes()
    rewrite(path, old + data)
    return len(old), len(data)
