"""Which checkpoint a directory and a tag name: the one place that reads ``latest`` and decides what is complete.

A folder is a checkpoint when it is a complete dsfunc checkpoint (it holds ``dsfunc_checkpoint.json``) or a
DeepSpeed checkpoint (it holds a ``*model_states.pt`` file; :mod:`dsfunc.checkpoint.deepspeed.folder`).
DeepSpeed writes ``latest`` the same way, so a DeepSpeed ``save_dir`` and its tags resolve here too.

A tag is checked by one rule on save and on load (:func:`check_tag`), the tag ``latest`` names too; and a
tag never leads out of its ``save_dir``: ``latest`` is read only as a small regular file (a link, a FIFO or
a device is refused), and a tag that is a symbolic link (``best -> global_step1``) is followed only to a
folder of the same ``save_dir``.
"""

from __future__ import annotations

import os
from pathlib import Path

from dsfunc.checkpoint.deepspeed.folder import is_deepspeed_folder
from dsfunc.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError
from dsfunc.checkpoint.files import is_folder, read_small
from dsfunc.checkpoint.paths import LATEST_FILE, META_FILE, replaced
from dsfunc.errors import InputError

PathLike = str | os.PathLike
MAX_TAG_BYTES = 200  # with the ".tmp-<id>" a save adds, the name stays within the 255 bytes of a file name
_TAG_RULE = (f"a tag is the name of a folder in save_dir: at most {MAX_TAG_BYTES} bytes of printable "
             f"characters, without whitespace, '/' or '\\', not starting with '.' and not {LATEST_FILE!r}")


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
        that tag, a tag that is a link out of ``load_dir``; the message lists the complete checkpoints that
        are there.
      CheckpointCorruptError: ``latest`` is not a small regular file holding a valid tag.
      InputError: ``tag`` is not a valid tag (the rule of :func:`save_checkpoint`).

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
    else:
        tag = check_tag(str(tag))
    folder = load_dir / tag
    if not _inside(load_dir, folder):
        raise CheckpointNotFoundError(
            f"{folder}{source} is a symbolic link to {folder.resolve()}, outside {load_dir}: a tag names a "
            f"checkpoint of its own save_dir only. To load that checkpoint, pass its folder as load_dir")
    if is_checkpoint_folder(folder):
        return folder
    if _complete(replaced(load_dir, tag)):  # a save over this tag died between its two renames
        return replaced(load_dir, tag)
    if not folder.exists():
        raise CheckpointNotFoundError(f"no checkpoint tagged {tag!r}{source} in {load_dir}; {listing}")
    raise CheckpointNotFoundError(
        f"{folder}{source} is not a complete dsfunc checkpoint: it has no {META_FILE} (a save that did not "
        f"finish, or a folder not written by dsfunc.save_checkpoint), nor is it a DeepSpeed checkpoint. "
        f"{listing[0].upper()}{listing[1:]}"
    )


def is_checkpoint_folder(folder: Path) -> bool:
    """Whether ``folder`` is a complete dsfunc checkpoint or a DeepSpeed checkpoint (its metadata file is there:
    whether it is a regular file is :func:`~dsfunc.checkpoint.metadata.read_meta`'s to say)."""
    return os.path.lexists(folder / META_FILE) or is_deepspeed_folder(folder)


def _complete(folder: Path) -> bool:
    """Whether ``folder`` itself (not a link) is a complete dsfunc checkpoint."""
    return is_folder(folder) and (folder / META_FILE).is_file()


def _inside(save_dir: Path, folder: Path) -> bool:
    """Whether ``folder``, a name in ``save_dir``, is a folder of ``save_dir`` itself or a link to one."""
    return not folder.is_symlink() or folder.resolve().parent == save_dir.resolve()


def available_tags(save_dir: PathLike) -> list[str]:
    """Tags of the complete checkpoints (dsfunc's or DeepSpeed's) in ``save_dir``, oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if not p.name.startswith(".") and _inside(root, p) and is_checkpoint_folder(p)]
    return [p.name for p in sorted(found, key=lambda p: (p / META_FILE if (p / META_FILE).is_file() else p)
                                     .stat().st_mtime)]


def read_latest(save_dir: Path) -> str | None:
    """The tag ``save_dir/latest`` names (one line, a valid tag), or None without one."""
    path = save_dir / LATEST_FILE
    try:
        data = read_small(path, 4 * MAX_TAG_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointCorruptError(f"cannot read {path}: {e}") from e
    try:
        tag = data.decode().removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError:
        raise CheckpointCorruptError(f"{path} is not text: it should hold the tag of a checkpoint in "
                                     f"{save_dir}; rewrite it, or pass tag=...") from None
    if not tag:
        return None
    problem = _tag_problem(tag)
    if problem is not None:
        raise CheckpointCorruptError(f"{path} names {tag!r}, which is not a tag ({problem}; {_TAG_RULE}): write "
                                     f"the tag of a checkpoint in {save_dir} into it, or pass tag=...")
    return tag


def check_tag(tag: str) -> str:
    """``tag`` if it can name a checkpoint folder inside ``save_dir``: the rule of saves and loads alike."""
    problem = _tag_problem(tag)
    if problem is not None:
        raise InputError(f"invalid checkpoint tag {tag!r}: {problem}; {_TAG_RULE}")
    return tag


def _tag_problem(tag: str) -> str | None:
    if not tag:
        return "it is empty"
    if tag.startswith("."):
        return "it starts with '.', as the names a save uses for its own files do"
    if tag == LATEST_FILE:
        return f"{LATEST_FILE!r} is the file naming the newest tag"
    bad = next((c for c in tag if c.isspace() or not c.isprintable() or c in "/\\"), None)
    if bad is not None:
        return f"it contains {bad!r}"
    if len(tag.encode()) > MAX_TAG_BYTES:
        return f"it is {len(tag.encode())} bytes long"
    return None
