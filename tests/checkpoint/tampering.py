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

from dsfunc.checkpoint.metadata import digest
from dsfunc.checkpoint.paths import META_FILE


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


# Pickles built opcode by opcode: what no pickler writes from an object, but an attacker writes by hand.
#: 9 bytes: PROTO 4, None, LONG_BINPUT 0x7fffffff, STOP (the C unpickler grows its memo to the index).
MEMO_INDEX = b"\x80\x04N" + b"r\xff\xff\xff\x7f" + b"."


def dict_with_key(key_body: bytes) -> bytes:
    """A protocol-2 pickle of ``{KEY: 1}`` whose key is built by the opcodes ``key_body``."""
    return b"\x80\x02}" + key_body + b"K\x01s."


def dag_key(levels: int) -> bytes:
    """A pickle of ``{t: 1}`` where ``t = (u, u)`` for ``u = (v, v)`` ... ``levels`` deep, each level shared
    through the memo: a few bytes per level, ``2**levels`` steps to hash."""
    t: tuple = ()
    for _ in range(levels):
        t = (t, t)
    return dict_with_key(pickle.dumps(t, protocol=2)[2:-1])


def deep_key(depth: int) -> bytes:
    """A pickle of ``{((...((),)...),): 1}``, the key nested ``depth`` deep (hashing it recurses in C)."""
    return dict_with_key(b")" + b"\x85" * depth)


def deep_lists(depth: int) -> bytes:
    """The opcodes of ``[[...[]...]]``, ``depth`` lists nested (a pickler would recurse that deep)."""
    return b"]" * depth + b"a" * (depth - 1)


class Call:
    """Pickled as the call ``fn(*args)``: what an attacker makes the unpickler do."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


def torch_file(data_pkl: bytes, records: dict[str, bytes] | None = None) -> bytes:
    """A ``torch.save`` zip file whose ``data.pkl`` is ``data_pkl`` (plus ``records``, e.g. storages)."""
    buffer = io.BytesIO()
    with torch.serialization._open_zipfile_writer(buffer) as archive:
        for name, data in {"data.pkl": data_pkl, "byteorder": b"little", **(records or {})}.items():
            archive.write_record(name, data, len(data))
    return buffer.getvalue()


def with_data_pkl(path: Path, edit: Any) -> bytes:
    """The bytes of the ``torch.save`` file ``path`` with its ``data.pkl`` replaced by ``edit(data.pkl)``."""
    reader = torch._C.PyTorchFileReader(str(path))
    records = {name: reader.get_record(name) for name in reader.get_all_records()
               if name not in ("data.pkl", "byteorder")}
    return torch_file(edit(reader.get_record("data.pkl")), records)


def add_item(key: str, value_body: bytes) -> Any:
    """An ``edit`` for :func:`with_data_pkl`: the pickled dict gets ``key`` set to the object ``value_body``
    builds (the dict is on top of the stack when the pickle stops)."""
    encoded = key.encode()
    return lambda data: data[:-1] + b"X" + len(encoded).to_bytes(4, "little") + encoded + value_body + b"s."
