"""A context in which any CUDA operation that synchronises with the host raises."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():  # "Synchronization debug mode is a prototype feature ..."
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
