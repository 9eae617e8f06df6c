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

_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")


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
    path = folder / CLIENT_FILE
    if trust_pickle:
        return torch.load(path, weights_only=False)
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = _REFUSED_GLOBAL.search(str(e))
        what = f"an object of type {found[1]}" if found else "objects beyond tensors, containers and numbers"
        raise CheckpointError(
            f"{path} holds {what}, which reading it with torch.load(weights_only=True) refuses. If you trust "
            "this checkpoint, load it with trust_pickle=True (full unpickling can run code); or save plain "
            "dicts, lists, numbers, strings and tensors as client_state."
        ) from None
