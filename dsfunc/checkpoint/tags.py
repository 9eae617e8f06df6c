"""Which checkpoint a directory and a tag name: the one place that reads ``latest`` and decides what is complete.

A folder is a checkpoint when it is a complete dsfunc checkpoint (it holds ``dsfunc_checkpoint.json``) or a
DeepSpeed checkpoint (it holds a ``*model_states.pt`` file; :mod:`dsfunc.checkpoint.deepspeed.layout`).
DeepSpeed writes ``latest`` the same way, so a DeepSpeed ``save_dir`` and its tags resolve here too.
"""

from __future__ import annotations

import os
from pathlib import Path

from dsfunc.checkpoint.deepspeed.layout import is_deepspeed_folder
from dsfunc.checkpoint.errors import CheckpointNotFoundError
from dsfunc.checkpoint.layout import LATEST_FILE, META_FILE, replaced
from dsfunc.errors import InputError

PathLike = str | os.PathLike


def find_checkpoint(load_dir: PathLike, tag: str | None = None) -> Path:
    """The folder of the complete checkpoint that ``load_dir`` and ``tag`` name; nothing is read or changed.

    Every loader resolves tags here (:func:`load_checkpoint`, :func:`export_fp32`, the engine), so a tag
    means the same everywhere. A save over an existing tag that died between its two renames leaves the
    complete old checkpoint in ``load_dir/.<tag>.replaced`` (see [Note: publishing a checkpoint] in
    :mod:`dsfunc.checkpoint.publish`): that folder is returned until the next save puts it back.

    Args:
      load_dir: a ``save_dir`` of :func:`save_checkpoint` or of DeepSpeed's ``engine.save_checkpoint``, or a
        checkpoint folder itself (with ``tag=None``).
      tag: which checkpoint (default: the one ``load_dir/latest`` names).

    Returns:
      The checkpoint folder, e.g. ``Path("ckpt/global_step100")``. :func:`load_checkpoint` accepts it as
      ``load_dir`` with ``tag=None``.

    Raises:
      CheckpointNotFoundError: no such directory, no ``latest`` and no tag, no complete checkpoint under
        that tag; the message lists the complete checkpoints that are there.

    Example::

        try:
            folder = dsfunc.checkpoint.find_checkpoint("ckpt")
        except dsfunc.CheckpointNotFoundError:
            folder = None  # nothing to resume from
    """
    load_dir = Path(load_dir)
    if tag is None and is_checkpoint_folder(load_dir):
        return load_dir  # a checkpoint folder itself
    if load_dir.is_file():
        raise CheckpointNotFoundError(
            f"{load_dir} is a file, not a checkpoint directory: checkpoints are the directories "
            "dsfunc.save_checkpoint (or DeepSpeed's engine.save_checkpoint) writes. A state_dict file loads into "
            f"the module itself: model.load_state_dict(torch.load({str(load_dir)!r})) (a .safetensors file: "
            "safetensors.torch.load_file), then dsfunc.init_state(model, config)"
        )
    if not load_dir.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {load_dir} does not exist")
    tags = available_tags(load_dir)
    listing = (f"complete checkpoints there: {', '.join(map(repr, tags))}" if tags
               else "it holds no complete checkpoint")
    source = ""
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            raise CheckpointNotFoundError(
                f"no `{LATEST_FILE}` file in {load_dir} and no tag given, so there is no checkpoint to pick; "
                f"pass tag=... ({listing})"
            )
        source = f" (named by {load_dir / LATEST_FILE})"
    tag = str(tag)
    folder = load_dir / tag
    if is_checkpoint_folder(folder):
        return folder
    if (replaced(load_dir, tag) / META_FILE).is_file():  # a save over this tag died between its two renames
        return replaced(load_dir, tag)
    if not folder.exists():
        raise CheckpointNotFoundError(f"no checkpoint tagged {tag!r}{source} in {load_dir}; {listing}")
    raise CheckpointNotFoundError(
        f"{folder}{source} is not a complete dsfunc checkpoint: it has no {META_FILE} (a save that did not "
        f"finish, or a folder not written by dsfunc.save_checkpoint), nor is it a DeepSpeed checkpoint. "
        f"{listing[0].upper()}{listing[1:]}"
    )


def is_checkpoint_folder(folder: Path) -> bool:
    """Whether ``folder`` is a complete dsfunc checkpoint or a DeepSpeed checkpoint."""
    return (folder / META_FILE).is_file() or is_deepspeed_folder(folder)


def available_tags(save_dir: PathLike) -> list[str]:
    """Tags of the complete checkpoints (dsfunc's or DeepSpeed's) in ``save_dir``, oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if not p.name.startswith(".") and is_checkpoint_folder(p)]
    return [p.name for p in sorted(found, key=lambda p: (p / META_FILE if (p / META_FILE).is_file() else p)
                                     .stat().st_mtime)]


def read_latest(save_dir: Path) -> str | None:
    """The tag ``save_dir/latest`` names, or None without one."""
    try:
        return (save_dir / LATEST_FILE).read_text().strip() or None
    except OSError:
        return None


def check_tag(tag: str) -> str:
    """``tag`` if it can name a checkpoint folder inside ``save_dir``."""
    if not tag or tag.startswith(".") or tag == LATEST_FILE or any(c in tag for c in ("/", os.sep, "\0")):
        raise InputError(
            f"invalid checkpoint tag {tag!r}: a tag is a folder name inside save_dir; it must be non-empty, "
            f"must not start with '.', contain '/' or be {LATEST_FILE!r}"
        )
    return tag
