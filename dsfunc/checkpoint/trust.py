"""What reading a checkpoint trusts it with, and the client state: pickled on save, read restrictedly on load.

[Note: verify, agree, then unpickle]
A load first checks every file against the sizes and sha256 of the metadata (each rank its share) and
combines the ranks' verdicts; only then does any rank unpickle anything (the client state here, DCP's
``.metadata`` when the tensors are read). So a damaged file is an error before code in it could run. The
checksums are not signatures, though: see :data:`TRUST_MODEL`.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dsfunc.checkpoint.errors import CheckpointError
from dsfunc.checkpoint.layout import CLIENT_FILE

#: The trust model of :func:`~dsfunc.load_checkpoint` and ``dsfunc export``, in one sentence (the README's
#: security note, the docstring and the command's help repeat it word for word).
TRUST_MODEL = (
    "Load or export only checkpoints you would run as code: the sha256 manifest detects damage, not "
    "tampering (whoever can write the files can rewrite it), and torch.distributed.checkpoint unpickles "
    "every checkpoint's .metadata in load_checkpoint and dsfunc export alike; only the client state is read "
    "with torch.load(weights_only=True) unless trust_pickle=True."
)

_REFUSED_GLOBAL = re.compile(r"(?:GLOBAL|global|function|class) ([\w.]+)")


def pickle_client_state(obj: Any) -> bytes:
    """The bytes of ``client_state.pt``: ``torch.save`` of ``obj`` (``{}`` for None)."""
    buffer = io.BytesIO()
    torch.save({} if obj is None else obj, buffer)
    return buffer.getvalue()


def read_client_state(folder: Path, meta: dict[str, Any], trust_pickle: bool) -> Any:
    """The client state of the (verified) checkpoint in ``folder``; ``{}`` when it has none.

    Without ``trust_pickle`` it is read with ``weights_only=True`` (tensors, dicts, lists, tuples, numbers,
    strings: what DeepSpeed scripts store); an object that needs full unpickling is an error naming the
    opt-in.
    """
    if CLIENT_FILE not in meta["files"]:
        return {}
    return load_pickle(folder / CLIENT_FILE, trust_pickle=trust_pickle)


def load_pickle(path: Path, *, trust_pickle: bool, safe_globals: Sequence[tuple[Any, str]] = (),
                **torch_load: Any) -> Any:
    """``torch.load(path)`` under the trust rule: weights-only (plus ``safe_globals``, stand-ins registered
    under a class's name) unless ``trust_pickle``; a refused object is an error naming its class and the
    opt-in. ``torch_load`` goes to ``torch.load`` (``map_location``, ``mmap``, ``pickle_module``, ...)."""
    if trust_pickle:
        return torch.load(path, weights_only=False, **torch_load)
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, weights_only=True, **torch_load)
    except pickle.UnpicklingError as e:
        found = _REFUSED_GLOBAL.search(str(e))
        what = f"an object of class {found[1]}" if found else "an object that is not plain data"
        raise CheckpointError(
            f"{path} holds {what} (not tensors, dicts, lists, numbers or strings), which only a full unpickling "
            "can rebuild and which may run code while it loads. If you trust this checkpoint, pass "
            "trust_pickle=True (dsfunc export: --trust-pickle); or save plain data as client_state."
        ) from None
