"""Telling, once, which keys of a config have no effect in dsfunc (:meth:`Config.without_effect`).

A log line rather than a warning: many configs set these keys (tutorials copy them at their defaults), and
a warning would be an error under ``filterwarnings = error``.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from dsfunc.config.config import Config

logger = logging.getLogger("dsfunc")
_SAID: set[str] = set()  # lines this process has logged already


def announce_without_effect(cfg: Config) -> None:
    """Log each of ``cfg``'s :meth:`~Config.without_effect` lines on the "dsfunc" logger, on rank 0, once per
    process (a second ``init_state`` with the same config says nothing)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    for line in cfg.without_effect():
        if line not in _SAID:
            _SAID.add(line)
            logger.warning("%s", line)
