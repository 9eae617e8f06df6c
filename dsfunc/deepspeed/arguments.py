"""DeepSpeed's command-line flags and where ``initialize`` takes its config from."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from dsfunc.errors import InputError

logger = logging.getLogger("dsfunc")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's flags to ``parser``: ``--deepspeed``, ``--deepspeed_config`` and the deprecated
    ``--deepscale``, ``--deepscale_config``.

    Unlike DeepSpeed, it also adds ``--local_rank`` (alias ``--local-rank``, default ``$LOCAL_RANK`` or
    -1) when the parser has neither, so a script started by a launcher that appends ``--local_rank=N``
    does not fail on an unknown argument; a parser that defines its own keeps it. Returns ``parser``.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for user code; it changes nothing in dsfunc)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    if not any(flag in parser._option_string_actions for flag in ("--local_rank", "--local-rank")):
        group.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", "-1")),
                           help="local rank set by a launcher (tolerated; dsfunc reads LOCAL_RANK)")
    return parser


def config_source(args: Any, config: Any) -> Any:
    """The config from ``config=`` or ``args.deepspeed_config`` (exactly one of them)."""
    if args is not None and getattr(args, "deepscale_config", None) is not None:
        logger.warning("--deepscale_config is deprecated, use --deepspeed_config")
        if getattr(args, "deepspeed_config", None) is not None:
            raise InputError(
                "both --deepscale_config and --deepspeed_config are set; keep --deepspeed_config only"
            )
        args.deepspeed_config = args.deepscale_config
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None and config is not None:
        raise InputError(
            "a DeepSpeed config came both from args.deepspeed_config "
            f"({from_args!r}) and from initialize(config=...); pass only one of them"
        )
    if from_args is None and config is None:
        raise InputError(
            "no DeepSpeed config: pass --deepspeed_config ds_config.json (add the flag to your parser with "
            "dsfunc.add_config_arguments(parser)) or initialize(config=<dict or path>)"
        )
    return config if config is not None else from_args


