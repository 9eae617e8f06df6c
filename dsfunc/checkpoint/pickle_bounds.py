"""Bounds on the memory, time and nesting a checkpoint's pickle may cost, checked before it is unpickled.

[Note: bounded unpickling]
The allow-lists of :mod:`.trust` decide which globals a pickle may name, not what its data costs: a memo
index of 9 bytes makes the C unpickler grow its memo to the index (up to 64 GiB), ``bytearray(N)`` and
``_codecs.encode`` allocate what they are asked, a key built as a DAG of tuples shared through the memo
takes 2**depth steps to hash, and a key nested millions deep overflows the C stack when hashed. So every
pickle of a checkpoint read without ``trust_pickle`` first goes through :func:`check_pickle`: one pass over
its opcodes (``pickletools.genops``, no recursion) that interprets none of its data but follows, for each
object it would build, how deep it nests and how large it is unfolded (a part reached twice through the
memo counted twice), and refuses, before any unpickler runs:

* a memo index beyond the objects stored so far (picklers number them 0, 1, 2, ...);
* objects nested deeper than :data:`MAX_DEPTH`;
* dict keys, set items and constructor arguments that unfold to more than :data:`WORK_PER_BYTE` times the
  pickle's size in all (hashing and comparing them costs their unfolded size; shared values are fine);
* ``bytearray`` and ``_codecs.encode`` that would produce more than :data:`ALLOC_PER_BYTE` times the
  pickle's size in all, ``_codecs.encode`` with another encoding than the latin1 ``torch.save`` writes
  bytes with, tensors and storages constructed from a size, and torch's rebuild functions that convert or
  expand a tensor beyond its stored bytes (:data:`_COPYING_REBUILDS`);
* an object changed after it was placed inside another (only reference cycles do that; it would make the
  sizes above stale), and opcodes no checkpoint needs (extensions, out-of-band buffers).

What it accepts then unpickles in memory and time linear in the file. Values may still share parts, so a
walk over a loaded structure keeps an id memo (``_detached`` in :mod:`.deepspeed.contents`), and a tensor
is copied only if its elements lie in its storage (:func:`check_tensor`). ``torch.save`` files are
checked whole: their zip members must be stored uncompressed within the file, and their ``data.pkl`` is
read with torch's own zip reader, as ``torch.load`` reads it.
"""

from __future__ import annotations

import io
import os
import pickletools
import re
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from dsfunc.checkpoint.errors import CheckpointCorruptError
from dsfunc.errors import Error

#: How deep a checkpoint's objects may nest (a training state nests a dozen levels).
MAX_DEPTH = 256
#: Unfolded size of everything hashed or passed to a constructor, per byte of the pickle.
WORK_PER_BYTE = 8
#: Bytes ``bytearray`` and ``_codecs.encode`` may produce, per byte of the pickle.
ALLOC_PER_BYTE = 2
_SLACK = 4096  # what a pickle of a few bytes may still cost

_BYTEARRAY = {"builtins.bytearray", "__builtin__.bytearray", "builtins.bytes", "__builtin__.bytes"}
_ENCODE = {"_codecs.encode", "codecs.encode"}
_LATIN1 = {"latin1", "latin-1", "latin_1", "iso-8859-1", "iso8859-1", "l1"}
_SIZED = re.compile(r"torch\.(?:cuda\.|storage\.)?\w*(?:Tensor|Storage)$")
_COPYING_REBUILDS = {f"torch._utils.{name}" for name in (
    "_rebuild_device_tensor_from_cpu_tensor", "_rebuild_device_tensor_from_numpy", "_rebuild_qtensor",
    "_rebuild_sparse_tensor", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass")}
_REFUSAL = ("dsfunc bounds the memory, time and nesting of every pickle it reads and checked this one before "
            "unpickling any of it. The file was crafted or damaged: load another checkpoint, or pass "
            "trust_pickle=True (dsfunc export: --trust-pickle), which lifts these bounds, only if you trust its "
            "origin.")


class _Obj:
    """What the scan knows of an object the pickle would build: its unfolded size and nesting depth,
    whether it was placed inside another, and for literals, globals and small tuples what they hold."""

    __slots__ = ("depth", "kind", "placed", "size", "value", "weight")

    def __init__(self, kind: str, value: Any = None, size: int = 0, weight: int = 1, depth: int = 0) -> None:
        self.kind, self.value, self.size = kind, value, size
        self.weight, self.depth, self.placed = weight, depth, False


class _Refused(Error):
    """What is wrong with the pickle (the message), raised inside the scan."""


def check_pickle(stream: IO[bytes], path: Path | str, size: int) -> _Obj | None:
    """Refuse the pickle that ``stream`` holds from its position (``size`` bytes or fewer, of ``path``)
    unless it unpickles within the bounds of [Note: bounded unpickling]; ``stream`` is left at its end.
    Returns what the scan knows of the object it holds."""
    scan = _Scan(size)
    try:
        for op, arg, pos in pickletools.genops(stream):
            scan.pos = pos
            scan.step(op.name, arg)
    except _Refused as e:
        raise CheckpointCorruptError(f"{path} holds a pickle that {e} (at byte {scan.pos}). {_REFUSAL}") from None
    except (ValueError, EOFError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{path} is not a readable pickle: {e}") from None
    return scan.stack[-1] if scan.stack else None


def check_torch_file(stream: IO[bytes], path: Path | str) -> None:
    """Refuse the ``torch.save`` file ``stream`` (seekable, read whole) unless its pickles pass
    :func:`check_pickle`; the position is restored."""
    start = stream.tell()
    size = stream.seek(0, os.SEEK_END)
    stream.seek(0)
    try:
        if torch.serialization._is_zipfile(stream):
            _check_members(stream, path, size)
            stream.seek(0)
            data = torch._C.PyTorchFileReader(stream).get_record("data.pkl")
            check_pickle(io.BytesIO(data), f"{path} (data.pkl)", len(data))
        else:
            _check_legacy(stream, path, size)
    except (RuntimeError, ValueError, EOFError, OSError, zipfile.BadZipFile) as e:  # what a damaged zip raises
        if isinstance(e, CheckpointCorruptError):
            raise
        raise CheckpointCorruptError(f"{path} is not a readable torch.save file: {type(e).__name__}: {e}") from None
    finally:
        stream.seek(start)


def check_torch_record(file: IO[bytes], offset: int, length: int, path: Path | str) -> None:
    """:func:`check_torch_file` for the ``torch.save`` record in bytes ``[offset, offset + length)`` of
    ``file`` (a tensor record of DCP's data files)."""
    with io.BufferedReader(_Window(file, offset, length)) as record:
        check_torch_file(record, f"{path} (bytes {offset}-{offset + length})")


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of ``file``, as a file of their own (it does not close ``file``)."""

    def __init__(self, file: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        self._file.seek(self._offset + self._pos)
        got = self._file.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got

    def close(self) -> None:  # the file stays open for its owner
        self._file = None
        super().close()


def check_tensor(t: torch.Tensor, path: Path | str) -> torch.Tensor:
    """``t``, refused if copying it would take more elements than its storage holds (an expanded view)."""
    if t.numel() * t.element_size() > t.untyped_storage().nbytes():
        raise CheckpointCorruptError(
            f"{path} holds a tensor of shape {tuple(t.shape)} whose {t.numel()} elements repeat the "
            f"{t.untyped_storage().nbytes()} bytes of its storage; copying it would allocate beyond the file. "
            f"{_REFUSAL}")
    return t


def _check_members(stream: IO[bytes], path: Path | str, size: int) -> None:
    """A zip's members: stored (torch.save compresses nothing), each name once, each within the file."""
    names = set()
    with zipfile.ZipFile(stream) as archive:
        for info in archive.infolist():
            if (info.compress_type != zipfile.ZIP_STORED or info.filename in names
                    or info.file_size > size or info.compress_size > size):
                raise CheckpointCorruptError(
                    f"{path} is not a torch.save file: its zip member {info.filename} is compressed, named "
                    f"twice or larger than the file ({info.file_size} bytes). {_REFUSAL}")
            names.add(info.filename)


def _check_legacy(stream: IO[bytes], path: Path | str, size: int) -> None:
    """torch's format before 1.6 (pickles in a row, then raw storages of sizes its pickle claims): torch
    reads past the first pickle only if it is the magic number, and dsfunc reads no such file untrusted."""
    first = check_pickle(stream, path, size)
    if first is not None and first.kind == "int" and first.value == torch.serialization.MAGIC_NUMBER:
        raise CheckpointCorruptError(
            f"{path} is in torch's file format before 1.6, whose storage sizes dsfunc cannot bound before "
            "reading them; save it again with a current torch, or pass trust_pickle=True (dsfunc export: "
            "--trust-pickle) if you trust its origin.")


class _Scan:
    """The abstract stack machine of :func:`check_pickle`: one handler per opcode (:data:`_HANDLERS`)."""

    def __init__(self, size: int) -> None:
        self.stack: list[_Obj] = []
        self.marks: list[int] = []
        self.memo: dict[int, _Obj] = {}
        self.work_left = WORK_PER_BYTE * size + _SLACK
        self.alloc_left = ALLOC_PER_BYTE * size + _SLACK
        self.cap = self.work_left + 1  # unfolded sizes saturate here
        self.pos = 0

    def step(self, name: str, arg: Any) -> None:
        handler = _HANDLERS.get(name)
        if handler is None:
            raise _Refused(f"uses the opcode {name}, which no checkpoint needs")
        handler(self, arg)

    def _int(self, arg: Any) -> None:
        self.stack.append(_Obj("int", int(arg)))

    def _text(self, arg: str) -> None:
        self.stack.append(_Obj("str", arg if len(arg) <= 256 else None, len(arg)))

    def _bytes(self, arg: bytes) -> None:
        self.stack.append(_Obj("bytes", None, len(arg)))

    def _leaf(self, arg: Any) -> None:
        self.stack.append(_Obj("leaf"))

    def _empty(self, arg: Any) -> None:
        self.stack.append(_Obj("mutable", depth=1))

    def _empty_tuple(self, arg: Any) -> None:
        self.stack.append(_Obj("tuple", (), depth=1))

    def _mark(self, arg: Any) -> None:
        self.marks.append(len(self.stack))
        self._deep(len(self.marks))

    def _tuple(self, items: list[_Obj]) -> None:
        self.stack.append(self._holding(_Obj("tuple", tuple(items) if len(items) <= 3 else None), items))

    def _frozenset(self, arg: Any) -> None:
        items = self._pop_mark()
        self._hash(items)
        self._tuple(items)

    def _list(self, arg: Any) -> None:
        self.stack.append(self._holding(_Obj("mutable"), self._pop_mark()))

    def _dict(self, arg: Any) -> None:
        items = self._pop_mark()
        self._hash(items[::2])
        self.stack.append(self._holding(_Obj("mutable"), items))

    def _append(self, arg: Any) -> None:  # APPEND, BUILD
        self._change(self._pop(1))

    def _setitem(self, arg: Any) -> None:
        items = self._pop(2)
        self._hash(items[:1])
        self._change(items)

    def _appends(self, arg: Any) -> None:
        self._change(self._pop_mark())

    def _setitems(self, arg: Any) -> None:
        items = self._pop_mark()
        self._hash(items[::2])
        self._change(items)

    def _additems(self, arg: Any) -> None:
        items = self._pop_mark()
        self._hash(items)
        self._change(items)

    def _pop_one(self, arg: Any) -> None:
        if self.marks and len(self.stack) == self.marks[-1]:
            self.marks.pop()
        else:
            self._pop(1)

    def _dup(self, arg: Any) -> None:
        self.stack.append(self._top())

    def _put(self, index: int | None) -> None:  # PUT, BINPUT, LONG_BINPUT, MEMOIZE (index None)
        index = len(self.memo) if index is None else index
        if not 0 <= index <= len(self.memo):
            raise _Refused(f"stores an object under memo index {index} when only {len(self.memo)} are stored "
                           "(the unpickler would allocate a memo of that length)")
        self.memo[index] = self._top()

    def _get(self, index: int) -> None:
        found = self.memo.get(index)
        if found is None:
            raise _Refused(f"reads memo index {index}, which it never stored")
        self.stack.append(found)

    def _global(self, arg: str) -> None:
        module, _, qualname = arg.partition(" ")
        self.stack.append(_Obj("global", f"{module}.{qualname}"))

    def _inst(self, arg: str) -> None:
        self._global(arg)
        self._call(self.stack.pop(), self._pop_mark())

    def _stack_global(self, arg: Any) -> None:
        module, qualname = self._pop(2)
        if module.kind != "str" or qualname.kind != "str" or None in (module.value, qualname.value):
            raise _Refused("names a global by something other than two short strings")
        self.stack.append(_Obj("global", f"{module.value}.{qualname.value}"))

    def _reduce(self, arg: Any) -> None:  # REDUCE, NEWOBJ
        func, args = self._pop(2)
        self._call(func, [args])

    def _newobj_ex(self, arg: Any) -> None:
        func, args, kwargs = self._pop(3)
        self._call(func, [args, kwargs])

    def _obj(self, arg: Any) -> None:
        items = self._pop_mark()
        if not items:
            raise _Refused("builds an object from nothing")
        self._call(items[0], items[1:])

    def _persid(self, arg: Any) -> None:
        self.stack.append(self._holding(_Obj("leaf"), self._pop(1)))

    def _nothing(self, arg: Any) -> None:  # PROTO, FRAME, STOP
        pass

    def _top(self) -> _Obj:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise _Refused("reads an object from an empty stack")
        return self.stack[-1]

    def _pop(self, n: int) -> list[_Obj]:
        if len(self.stack) - (self.marks[-1] if self.marks else 0) < n:
            raise _Refused("reads an object from an empty stack")
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def _pop_mark(self) -> list[_Obj]:
        if not self.marks:
            raise _Refused("closes a MARK it never opened")
        items = self.stack[self.marks[-1]:]
        del self.stack[self.marks.pop():]
        return items

    def _deep(self, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _Refused(f"nests objects more than {MAX_DEPTH} deep")

    def _holding(self, obj: _Obj, items: list[_Obj]) -> _Obj:
        """``obj`` with ``items`` placed inside it: its size and depth grow by theirs."""
        weight, depth = obj.weight, obj.depth
        for item in items:
            item.placed = True
            weight += item.weight
            if item.depth >= depth:
                depth = item.depth + 1
        obj.weight, obj.depth = min(self.cap, weight), depth
        if depth > MAX_DEPTH:
            self._deep(depth)
        return obj

    def _change(self, items: list[_Obj]) -> None:
        """``items`` placed into the object on top of the stack (append, setitem, build)."""
        target = self._top()
        if target.placed:
            raise _Refused("changes an object after placing it inside another (a reference cycle)")
        if target.kind != "mutable":
            target.kind, target.value = "object", None
        self._holding(target, items)

    def _hash(self, items: list[_Obj]) -> None:
        """Charge hashing ``items`` (dict keys, set items), which costs their unfolded size."""
        self._work(sum(item.weight for item in items), "dict keys or set items")

    def _work(self, weight: int, what: str) -> None:
        self.work_left -= weight
        if self.work_left < 0:
            raise _Refused(f"holds {what} whose parts are shared so often (through the memo) that hashing or "
                           f"building them would take more than {WORK_PER_BYTE} steps per byte of the pickle")

    def _call(self, func: _Obj, args: list[_Obj]) -> None:
        """``func(*args)`` (reduce, newobj, obj, inst): the arguments are charged as work, and what the
        callable allocates against the allocation budget."""
        self._work(sum(a.weight for a in args), "constructor arguments")
        name = func.value if func.kind == "global" else ""
        result = _Obj("object")
        if name in _BYTEARRAY or name in _ENCODE:
            result = _Obj("bytes", size=self._alloc(name, args))
        elif _SIZED.match(name) and any(a.kind != "tuple" or a.value != () for a in args):
            raise _Refused(f"constructs {name} from arguments (a size would allocate that many elements; "
                           "torch.save never writes one)")
        elif name in _COPYING_REBUILDS:
            raise _Refused(f"rebuilds a tensor with {name}, which can allocate beyond the file (dsfunc reads "
                           "dense tensors stored in the file)")
        self.stack.append(self._holding(result, [func, *args]))

    def _alloc(self, name: str, args: list[_Obj]) -> int:
        """Charge what ``bytearray``/``bytes``/``_codecs.encode`` produce from their arguments (literals, or
        bytes they made before); return its size."""
        given = args[0].value if len(args) == 1 and args[0].kind == "tuple" else None
        if given is None:
            raise _Refused(f"calls {name} with arguments dsfunc cannot size")
        produced = None
        if name in _ENCODE:
            if (1 < len(given) <= 3 and given[0].kind == "str" and given[1].kind == "str"
                    and str(given[1].value).lower() in _LATIN1):
                produced = given[0].size
        elif not given:
            produced = 0
        elif len(given) == 1 and given[0].kind == "int":
            produced = max(given[0].value, 0)
        elif given[0].kind in ("str", "bytes") and (len(given) == 1 or given[1].kind == "str"):
            produced = given[0].size
        if produced is None:
            raise _Refused(f"calls {name} with arguments torch.save never writes (only a string encoded as "
                           "latin1, bytes or a size)")
        self.alloc_left -= produced
        if self.alloc_left < 0:
            raise _Refused(f"asks bytearray/_codecs.encode for more bytes than {ALLOC_PER_BYTE} per byte of "
                           "the pickle")
        return produced


_HANDLERS = {
    **dict.fromkeys(("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"), _Scan._int),
    **dict.fromkeys(("STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
                     "BINUNICODE8"), _Scan._text),
    **dict.fromkeys(("BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8"), _Scan._bytes),
    **dict.fromkeys(("NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT", "PERSID"), _Scan._leaf),
    **dict.fromkeys(("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"), _Scan._empty),
    "EMPTY_TUPLE": _Scan._empty_tuple, "MARK": _Scan._mark,
    "TUPLE": lambda scan, arg: scan._tuple(scan._pop_mark()),
    "TUPLE1": lambda scan, arg: scan._tuple(scan._pop(1)), "TUPLE2": lambda scan, arg: scan._tuple(scan._pop(2)),
    "TUPLE3": lambda scan, arg: scan._tuple(scan._pop(3)),
    "FROZENSET": _Scan._frozenset, "LIST": _Scan._list, "DICT": _Scan._dict,
    "APPEND": _Scan._append, "BUILD": _Scan._append, "SETITEM": _Scan._setitem, "APPENDS": _Scan._appends,
    "SETITEMS": _Scan._setitems, "ADDITEMS": _Scan._additems,
    "POP": _Scan._pop_one, "POP_MARK": lambda scan, arg: scan._pop_mark(), "DUP": _Scan._dup,
    **dict.fromkeys(("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"), _Scan._put),
    **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), _Scan._get),
    "GLOBAL": _Scan._global, "INST": _Scan._inst, "STACK_GLOBAL": _Scan._stack_global,
    "REDUCE": _Scan._reduce, "NEWOBJ": _Scan._reduce, "NEWOBJ_EX": _Scan._newobj_ex, "OBJ": _Scan._obj,
    "BINPERSID": _Scan._persid, **dict.fromkeys(("PROTO", "FRAME", "STOP"), _Scan._nothing),
}  # no EXT1/2/4 (the copyreg extension registry) nor NEXT_BUFFER/READONLY_BUFFER (out-of-band buffers)
