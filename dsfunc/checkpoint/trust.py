"""What reading a checkpoint trusts it with: every pickle in it is read through an allow-list unless
``trust_pickle=True``, and the client state is pickled on save here.

[Note: verify, agree, then unpickle]
A load first checks every file against the sizes and sha256 of the metadata (each rank its share) and
combines the ranks' verdicts; only then does any rank unpickle anything (the client state, DCP's
``.metadata``). So a damaged file is an error before any of its bytes are interpreted. The checksums are
not signatures, though: see :data:`TRUST_MODEL`.

[Note: one trust rule, two unpicklers]
Without ``trust_pickle`` no pickle of a checkpoint may name a global beyond an allow-list, so no code from
the file runs. ``torch.save`` files (the client state, DeepSpeed's files) go through torch's weights-only
unpickler (:func:`load_pickle`), which knows how tensors are rebuilt. DCP's ``.metadata`` is a plain
``pickle.dump`` in protocol 4, whose framing torch's weights-only unpickler does not read ("Unsupported
operand 149", torch 2.13), so it goes through the standard library's unpickler restricted to named globals
(:func:`load_plain_pickle`, as the ``pickle`` documentation's "Restricting Globals" does). A refusal from
either is the same error, naming the file, the class and the opt-in. Both first check the pickle's
bounds ([Note: bounded unpickling] in :mod:`.pickle_bounds`): an allow-list bounds what code runs, not
what memory, time and nesting the data costs.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from dsfunc.checkpoint.errors import CheckpointError
from dsfunc.checkpoint.paths import CLIENT_FILE
from dsfunc.checkpoint.pickle_bounds import check_pickle, check_torch_file

#: The trust model of :func:`~dsfunc.load_checkpoint` and ``dsfunc export``, in one sentence (the README's
#: security note, the docstring and the command's help repeat it word for word).
TRUST_MODEL = (
    "The sha256 manifest detects damage, not tampering (whoever can write the files can rewrite it), so "
    "every pickle of a checkpoint (DCP's .metadata and tensor records, the client state, DeepSpeed's .pt "
    "files) is read through an allow-list of plain data, tensors and the checkpoint formats' own classes, in "
    "load_checkpoint and dsfunc export alike: no code from a checkpoint runs unless you pass "
    "trust_pickle=True (dsfunc export --trust-pickle), which only a checkpoint you would run as code "
    "deserves."
)

_REFUSED_GLOBAL = re.compile(r"(?:GLOBAL|global|function|class) ([\w.]+)")


def pickle_client_state(obj: Any) -> bytes:
    """The bytes of ``client_state.pt``: ``torch.save`` of ``obj`` (``{}`` for None)."""
    buffer = io.BytesIO()
    torch.save({} if obj is None else obj, buffer)
    return buffer.getvalue()


def read_client_state(folder: Path, trust_pickle: bool) -> Any:
    """The client state of the (verified) checkpoint in ``folder``, which the manifest lists
    (:func:`~dsfunc.checkpoint.metadata.verify_files`).

    Without ``trust_pickle`` it is read with ``weights_only=True`` (tensors, dicts, lists, tuples, numbers,
    strings: what DeepSpeed scripts store); an object that needs full unpickling is an error naming the
    opt-in.
    """
    return load_pickle(folder / CLIENT_FILE, trust_pickle=trust_pickle)


def load_pickle(path: Path, *, trust_pickle: bool, safe_globals: Sequence[tuple[Any, str]] = (),
                **torch_load: Any) -> Any:
    """``torch.load(path)`` under the trust rule: bounded and weights-only (plus ``safe_globals``, stand-ins
    registered under a class's name) unless ``trust_pickle``; a refused object is an error naming its class
    and the opt-in. ``torch_load`` goes to ``torch.load`` (``map_location``, ``mmap``, ``pickle_module``, ...)."""
    if trust_pickle:
        return torch.load(path, weights_only=False, **torch_load)
    with open(path, "rb") as f:
        check_torch_file(f, path)
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, weights_only=True, **torch_load)
    except pickle.UnpicklingError as e:
        raise refusal(path, refused_global(str(e)), "tensors, dicts, lists, numbers or strings",
                      "; or save plain data as client_state") from None


def load_plain_pickle(file: IO[bytes], path: Path, *, trust_pickle: bool, allowed: Mapping[str, Any],
                      plain: str) -> Any:
    """``pickle.load(file)`` (read from ``path``) under the trust rule: bounded and only the globals of
    ``allowed`` (by the ``module.name`` pickle records) unless ``trust_pickle``; ``plain`` says what they
    are (the error)."""
    if trust_pickle:
        return pickle.load(file)
    start = file.tell()
    check_pickle(file, path, os.fstat(file.fileno()).st_size - start)
    file.seek(start)
    try:
        return _AllowList(file, allowed).load()
    except _Refused as e:
        raise refusal(path, str(e), plain) from None


def refused_global(message: str) -> str | None:
    """The ``module.name`` a message of torch's weights-only unpickler says it refused, if it says."""
    found = _REFUSED_GLOBAL.search(message)
    return found[1] if found else None


def refusal(path: Path, found: str | None, plain: str, advice: str = "") -> CheckpointError:
    """The error for a pickle that needs a global beyond the allow-list: the file, the class, the opt-in."""
    what = f"an object of class {found}" if found else "an object that is not plain data"
    return CheckpointError(
        f"{path} holds {what} (not {plain}), which only a full unpickling can rebuild and which may run "
        "code while it loads; nothing of it was run. If you trust this checkpoint's origin, pass "
        f"trust_pickle=True (dsfunc export: --trust-pickle){advice}."
    )


class _Refused(CheckpointError):
    """A global the allow-list does not hold (its ``module.name`` is the message); caught and reworded by
    :func:`load_plain_pickle`."""


class _AllowList(pickle.Unpickler):
    """The standard unpickler that resolves only the globals named in ``allowed``, and no persistent ids."""

    def __init__(self, file: IO[bytes], allowed: Mapping[str, Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get(f"{module}.{name}")
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found
