"""Reading DeepSpeed's ``torch.save`` files without DeepSpeed and without running code from them.

[Note: DeepSpeed's classes without DeepSpeed]
Besides tensors, dicts, lists, numbers and strings (what ``torch.load(weights_only=True)`` accepts),
DeepSpeed's optimizer files pickle a few of DeepSpeed's own objects: the loss scaler (``LossScaler``,
``DynamicLossScaler``), the ZeRO stage (``ZeroStageEnum``) and each parameter's place in a partition
(``fragment_address``). We never import them. torch's weights-only unpickler accepts extra globals under
an explicit name (``torch.serialization.safe_globals([(obj, "module.Name")])``), so those names are
mapped to plain stand-ins here: :class:`DeepSpeedObject` subclasses that only receive the pickled
attributes (the stage becomes an ``int``). No code from the file runs and ``deepspeed`` need not be
installed. Anything else that is not plain data — typically the user's own objects in the client
state — stops the load with an error that names the file, the class and the opt-in ``trust_pickle=True``.
Trusted, a file is read by the ordinary unpickler: the same DeepSpeed names still map to the stand-ins
(so DeepSpeed stays optional), every other class is imported and may run code, as ``torch.load`` does.

Files are memory-mapped (``mmap=True``): a tensor's bytes are read from the page cache when a piece of
it is copied, so opening a shard costs its pickle, not its tensors.
"""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any, ClassVar

from dsfunc.checkpoint.errors import CheckpointCorruptError, CheckpointError
from dsfunc.checkpoint.trust import load_pickle


class DeepSpeedObject:
    """A DeepSpeed object read from a checkpoint: the attributes it was pickled with, no behaviour."""

    ds_class: ClassVar[str] = ""

    def __repr__(self) -> str:
        return f"<{self.ds_class} {vars(self)}>"


def _stand_in(path: str) -> type[DeepSpeedObject]:
    return type(path.rsplit(".", 1)[1], (DeepSpeedObject,), {"ds_class": path, "__module__": __name__})


def _zero_stage(value: int) -> int:
    """``ZeroStageEnum(value)``, read as the plain stage number."""
    return int(value)


STAND_INS: dict[str, Any] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _stand_in("deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler":
        _stand_in("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    "deepspeed.utils.tensor_fragment.fragment_address":
        _stand_in("deepspeed.utils.tensor_fragment.fragment_address"),
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
}


class _TrustedUnpickler(pickle.Unpickler):
    """The ordinary unpickler, except that DeepSpeed's known classes become the stand-ins."""

    def find_class(self, module: str, name: str) -> Any:
        return STAND_INS.get(f"{module}.{name}") or super().find_class(module, name)


_TRUSTED = types.SimpleNamespace(Unpickler=_TrustedUnpickler, load=pickle.load, __name__="dsfunc_trusted_pickle")
_SAFE_GLOBALS = [(obj, name) for name, obj in STAND_INS.items()]


def load_file(path: Path, *, trust_pickle: bool = False) -> Any:
    """The object in the DeepSpeed file ``path``, its tensors memory-mapped on the CPU.

    Raises:
      CheckpointError: the file holds objects other than plain data and DeepSpeed's known classes, and
        ``trust_pickle`` is False (the message names the class and the argument).
      CheckpointCorruptError: the file is missing or cannot be read.
    """
    extra = {"pickle_module": _TRUSTED} if trust_pickle else {}
    try:
        return _load(path, trust_pickle=trust_pickle, safe_globals=_SAFE_GLOBALS, **extra)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:  # a trusted load that still fails: the file is broken
        raise CheckpointCorruptError(f"cannot read the DeepSpeed file {path}: {e}") from e
    except FileNotFoundError as e:
        raise CheckpointCorruptError(f"the DeepSpeed checkpoint file {path} is missing") from e
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointCorruptError(f"cannot read the DeepSpeed file {path}: {type(e).__name__}: {e}") from e


def _load(path: Path, **kwargs: Any) -> Any:
    """``torch.load`` under the trust rule, memory-mapped, or whole for files in torch's legacy (pre-zip)
    format."""
    try:
        return load_pickle(path, map_location="cpu", mmap=True, **kwargs)
    except RuntimeError as e:
        if "zipfile" not in str(e) and "mmap" not in str(e):
            raise
        return load_pickle(path, map_location="cpu", **kwargs)
