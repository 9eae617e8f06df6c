"""Checkpoints of a :class:`~dsfunc.TrainState`: atomic, resharding saves and loads, and fp32 export.

Every rank calls :func:`save_checkpoint` and :func:`load_checkpoint` with the same tag (a rank that does
not is named in a :class:`CheckpointTimeoutError`, never a hang); :func:`export_fp32` and :func:`export_hf`
(``dsfunc export``) run offline. DeepSpeed's checkpoints load and export the same way.
One module per concept:

* :mod:`.api`: the calls themselves, orchestrating the rest;
* :mod:`.paths`: what a checkpoint folder and ``save_dir`` hold, file by file;
* :mod:`.keys`: the state's tensors under world-size-independent keys, which is why any world size, ZeRO
  stage and precision loads any checkpoint (**resharding**);
* :mod:`.publish`: the write, rename and ``latest`` protocol that makes a save appear whole or not at all
  (**atomicity**);
* :mod:`.locks`: several jobs saving into one ``save_dir`` (a lock per ``save_dir``, a claim per save);
* :mod:`.tags`: which folder a directory and tag name (:func:`find_checkpoint`), by one tag rule;
* :mod:`.metadata`: the metadata file, and the sizes and sha256 the files are checked against;
* :mod:`.schema`: the shape the metadata file must have, checked once where it is read;
* :mod:`.files`: a checkpoint's files read only as regular files inside their folder;
* :mod:`.trust`: what loading trusts a checkpoint with (:data:`TRUST_MODEL`): the restricted unpickling
  every reader uses, and the client state's pickling;
* :mod:`.pickle_bounds`: the memory, time and nesting any checkpoint pickle may cost, checked before it
  is unpickled;
* :mod:`.compat`: whether a checkpoint fits a template state;
* :mod:`.coordination`: how the ranks meet, agree and fail together;
* :mod:`.dcp_io`: the calls into ``torch.distributed.checkpoint``;
* :mod:`.export`: the consolidated fp32 ``state_dict`` file (its command line, ``dsfunc export``, is
  :func:`dsfunc.cli.export`);
* :mod:`.hf`: the Hugging Face model directory (``dsfunc export --hf-config``);
* :mod:`.deepspeed`: DeepSpeed's own checkpoints, loaded into any world size and stage, and exported;
* :mod:`.errors`: what a failed save or load raises.
"""

from dsfunc.checkpoint.api import load_checkpoint, save_checkpoint, wait_for_checkpoint
from dsfunc.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointTagError,
    CheckpointTimeoutError,
    CheckpointUnsupportedError,
)
from dsfunc.checkpoint.export import export_fp32
from dsfunc.checkpoint.hf import export_hf
from dsfunc.checkpoint.paths import META_FILE
from dsfunc.checkpoint.tags import available_tags, find_checkpoint

__all__ = [
    "META_FILE",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointTagError",
    "CheckpointTimeoutError",
    "CheckpointUnsupportedError",
    "available_tags",
    "export_fp32",
    "export_hf",
    "find_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "wait_for_checkpoint",
]
