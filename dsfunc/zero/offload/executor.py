"""ZeRO-Offload's host update in the background, so that the next step's forward overlaps it.

With the optimizer offloaded the update is the longest part of a step: a pass of the host Adam through
every master and moment, bound by host memory bandwidth (about 1 s for 4.1B parameters on the H200
machine's 16 cores), while the GPU waited. At stage 3 the next forward needs the units one at a time, in order, so a
step queues the update of its lazy units here (:meth:`HostExecutor.add`) and returns once it has started
(:meth:`HostExecutor.start`): the update in flight is a future the executor owns; a worker thread updates them unit by unit and each unit's new 16-bit shard
goes to the device on a copy stream as soon as it is written. The next forward waits for each unit just
before it gathers it (:meth:`HostExecutor.wait_unit`), so the update runs beside the forward: the same
operations on the same numbers as the update in place, bit for bit.

Everything else that reads the masters or the optimizer state first waits for all of it, where it must and
visibly (:meth:`HostExecutor.wait`, through :meth:`dsfunc.run.RunContext.wait`): the next update, a checkpoint,
``full_params``, ``GatheredParameters``. Reading a state's fields or flattening it never waits. A failure in the worker is raised there, in the caller's thread. The
worker runs no collectives (every rank's collectives stay on its main thread, in program order): it
writes host tensors and copies to the device. It keeps one core for the main thread (its intra-op threads
are one fewer): on 16 cores, 16 threads beside the thread that launches the forward cost 13% of the step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from dsfunc.optim.update import UnitWork


class HostExecutor:
    """The host update of one step's lazy units, queued, then run by one worker thread as a future it owns."""

    def __init__(self, compute_device: torch.device) -> None:
        self._cuda = compute_device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(compute_device) if self._cuda else None
        self._pool: ThreadPoolExecutor | None = None
        self._queued: list[tuple[list[str], UnitWork]] = []
        self._future: Future | None = None
        self._written: dict[str, threading.Event] = {}  # unit -> set once its update (and copy) is queued
        self._copied: dict[str, torch.cuda.Event] = {}  # unit -> after its copy to the device, on the copy stream
        self._failed = False
        self._threads = max(1, torch.get_num_threads() - 1)
        self.waited_units = 0  # units a caller found not yet written (how much the overlap happened)
        self.seconds = 0.0  # how long the last update took in the worker

    @property
    def in_flight(self) -> bool:
        """True from :meth:`start` until :meth:`wait` has returned."""
        return self._future is not None

    def add(self, names: list[str], work: UnitWork) -> None:
        """Queue ``work(names)`` for the worker; it must call :meth:`unit_done` after each unit."""
        self._queued.append((list(names), work))

    def start(self) -> None:
        """Run what :meth:`add` queued, in order, in the background."""
        if not self._queued:
            return
        if self._future is not None:
            raise RuntimeError("a host update is still in flight; wait() for it before starting another")
        jobs, self._queued = self._queued, []
        self._written = {name: threading.Event() for names, _ in jobs for name in names}
        self._copied = {}
        self._failed = False
        self._future = self._worker().submit(self._run, jobs)

    def submit(self, job: Callable[[], None]) -> Future:
        """Run ``job`` in the worker after what is queued before it, as a future of its own (a unit's update
        ahead of the step: :mod:`dsfunc.zero.offload.speculation`)."""
        return self._worker().submit(self._run_one, job)

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsfunc-host-update")
        return self._pool

    def _run_one(self, job: Callable[[], None]) -> None:
        torch.set_num_threads(self._threads)
        with torch.no_grad():
            job()

    def _run(self, jobs: list[tuple[list[str], UnitWork]]) -> None:
        stream = torch.cuda.stream(self._copy_stream) if self._cuda else contextlib.nullcontext()
        torch.set_num_threads(self._threads)  # this thread's own count (OpenMP's is per thread)
        start = time.perf_counter()
        try:
            with torch.no_grad(), stream:
                for names, work in jobs:
                    work(names)
        except BaseException:
            self._failed = True
            raise
        finally:  # on a failure too: nobody may wait for a unit forever; wait_unit() then raises
            self.seconds = time.perf_counter() - start
            for event in self._written.values():
                event.set()

    def unit_done(self, name: str) -> None:
        """Called by the worker once unit ``name`` is written and its copy to the device is queued."""
        if self._cuda:
            copied = self._copied[name] = torch.cuda.Event()
            copied.record(self._copy_stream)
        self._written[name].set()

    def wait_unit(self, name: str) -> None:
        """Return once unit ``name`` is updated (the current stream then waits for its copy to the device)."""
        written = self._written.get(name) if self._future is not None else None
        if written is None:
            return
        if not written.is_set():
            self.waited_units += 1
            written.wait()
        if self._failed:
            self.wait()  # raises the worker's error
        copied = self._copied.get(name)
        if copied is not None:
            torch.cuda.current_stream().wait_event(copied)

    def wait(self) -> bool:
        """Return once the whole update is done (True if one was in flight); raise what the worker raised."""
        future = self._future
        if future is None:
            return False
        try:
            future.result()
        finally:
            self._future, self._written = None, {}
        if self._cuda:  # what read the state next may be on any stream
            torch.cuda.current_stream().wait_stream(self._copy_stream)
        return True
