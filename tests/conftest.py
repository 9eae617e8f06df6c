"""Every test starts without a process group: ``deepspeed.initialize`` and ``zero.Init`` form a one-process
group in a process no launcher started (as DeepSpeed's do), which would otherwise outlive the test that
made it and change what later tests in the same worker see."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_lone_group_left() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()
