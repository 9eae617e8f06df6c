"""The ``dsfunc`` command: ``dsfunc export ...``, or the launcher ``dsfunc [flags] script.py [args]``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``dsfunc`` console script; exits with the job's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:
        sys.exit(export(argv[1:]))
    from dsfunc.launcher.commands import LauncherError
    from dsfunc.launcher.environment import EnvFileError
    from dsfunc.launcher.flags import parse_launcher_args
    from dsfunc.launcher.resources import ResourceError
    from dsfunc.launcher.run import launch

    args = parse_launcher_args(argv)
    try:
        code = launch(args)
    except (LauncherError, ResourceError, EnvFileError) as e:
        print(f"dsfunc: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


def export(argv: Sequence[str] | None = None) -> int:
    """``dsfunc export CKPT_DIR OUT [--tag T] [--format safetensors|pt] [--hf-config DIR [--max-shard-size S]]
    [--trust-pickle] [--no-verify]``: :func:`dsfunc.checkpoint.export_fp32` or
    :func:`~dsfunc.checkpoint.export_hf`; returns the exit code."""
    # imported here, not at the top: the launcher's start should not wait for torch
    from dsfunc.checkpoint.errors import CheckpointError
    from dsfunc.checkpoint.export import FORMATS, export_fp32
    from dsfunc.checkpoint.hf import DEFAULT_SHARD_SIZE, export_hf
    from dsfunc.checkpoint.trust import TRUST_MODEL

    parser = argparse.ArgumentParser(
        prog="dsfunc export",
        description="Write the weights of a dsfunc or DeepSpeed checkpoint as one consolidated fp32 state_dict "
                    "file that plain model.load_state_dict accepts, or (--hf-config) as a Hugging Face model "
                    "directory; no process group needed.",
        epilog=f"Security: {TRUST_MODEL}",
    )
    parser.add_argument("ckpt_dir", help="a save_dir of dsfunc.save_checkpoint or of DeepSpeed, or a checkpoint "
                                         "folder")
    parser.add_argument("out", help="output file (*.safetensors, or *.pt/.pth/.bin); with --hf-config, the "
                                    "model directory to create")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one CKPT_DIR/latest names)")
    parser.add_argument("--format", choices=FORMATS, default=None, help="default: from OUT's suffix")
    parser.add_argument("--hf-config", default=None, metavar="DIR",
                        help="write a Hugging Face directory, with the config.json found in DIR "
                             "(model.config.save_pretrained(DIR) writes one)")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE,
                        help=f"with --hf-config: bytes per safetensors file, e.g. 500MB (default "
                             f"{DEFAULT_SHARD_SIZE})")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="read the checkpoint's pickles (DCP's .metadata, DeepSpeed's .pt files) with full "
                             "unpickling, for objects beyond plain data, tensors and the formats' own classes: "
                             "it can run code, so only for a checkpoint whose origin you trust")
    parser.add_argument("--no-verify", action="store_true", help="skip checking the files' sha256")
    args = parser.parse_args(argv)
    if _holds_checkpoint(Path(args.out)):  # writing there could mix the export into a checkpoint
        print(f"dsfunc export: error: OUT {args.out} is a checkpoint directory; the arguments are CKPT_DIR then "
              f"OUT (did you mean `dsfunc export {args.out} {args.ckpt_dir}`?)", file=sys.stderr)
        return 1
    try:
        if args.hf_config is not None:
            out = export_hf(args.ckpt_dir, args.out, args.hf_config, tag=args.tag,
                            max_shard_size=args.max_shard_size, verify=not args.no_verify,
                            trust_pickle=args.trust_pickle)
            size = sum(p.stat().st_size for p in Path(out).iterdir())
        else:
            out = export_fp32(args.ckpt_dir, args.out, tag=args.tag, format=args.format,
                              verify=not args.no_verify, trust_pickle=args.trust_pickle)
            size = os.path.getsize(out)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"dsfunc export: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")
    return 0


def _holds_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint folder or a ``save_dir`` holding one (or a ``latest`` file)."""
    from dsfunc.checkpoint.paths import LATEST_FILE
    from dsfunc.checkpoint.tags import available_tags, is_checkpoint_folder

    return path.is_dir() and (is_checkpoint_folder(path) or (path / LATEST_FILE).is_file()
                              or bool(available_tags(path)))


if __name__ == "__main__":
    main()

