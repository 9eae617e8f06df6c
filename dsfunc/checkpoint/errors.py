"""What a failed save or load raises: one class per cause, all of them :class:`CheckpointError`."""

from __future__ import annotations

from dsfunc.errors import Error


class CheckpointError(Error, RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why and what to do."""


class CheckpointNotFoundError(CheckpointError):
    """No complete checkpoint at the given directory and tag."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or changed since it was written."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the template state (model, unit layout or optimizer)."""


class CheckpointTimeoutError(CheckpointError):
    """Not every rank called save/load within the timeout."""


class CheckpointTagError(CheckpointError, AssertionError):
    """The ranks gave different tags to a save whose config says ``checkpoint.tag_validation: "Fail"`` (an
    ``AssertionError`` too: DeepSpeed asserts, and scripts catch that), or to a load."""


class CheckpointUnsupportedError(CheckpointError):
    """A checkpoint in a layout dsfunc does not import (DeepSpeed's model/pipeline parallel, MoE, NVMe offload)."""


# by name, so that every rank can raise the class one rank raised (only the name travels between ranks)
BY_NAME = {cls.__name__: cls for cls in (CheckpointError, CheckpointNotFoundError, CheckpointCorruptError,
                                         CheckpointMismatchError, CheckpointTimeoutError, CheckpointTagError,
                                         CheckpointUnsupportedError)}
