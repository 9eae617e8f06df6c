"""Every test starts without a process group: ``deepspeed.initialize`` and ``zero.Init`` form a one-process
group in a process no launcher started (as DeepSpeed's do), which would otherwise outlive the test that
made it and change what later tests in the same worker see.

Tests that compute in the pytest process use one intra-op thread, as every rank of tests/multiprocess.py does:
the suite runs two workers on two cores beside the ranks they start, and OpenMP threads spinning for a core
made such a test 10x slower (the README's quickstart: 34 s beside a notebook, 2.5 s on one thread). A test
about thread counts sets its own.

The CPU kernels (ops/adam_cpu.cpp) are built once before any test runs, by the process that starts the workers:
on a fresh machine a worker's test would otherwise wait minutes for the other's build, and a notebook would print
that wait to its stderr."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(1)


def pytest_sessionstart(session: pytest.Session) -> None:
    if not (hasattr(session.config, "workerinput") or session.config.option.collectonly):  # xdist's workers have it
        from dsfunc.kernels.native import native_ready

        native_ready("cpu")


@pytest.fixture(autouse=True)
def _no_lone_group_left() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()
