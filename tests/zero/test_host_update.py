"""ZeRO-Offload's host update in the background (dsfunc.zero.offload.executor): the next forward overlaps it unit by
unit, nothing reads a half-written update, and a failure in it is raised, not lost.

The worker is held back where a test needs the overlap to happen for certain (``hold_worker``): it starts its
update only once the main thread waits for a unit, or after a pause; nothing else about it is replaced.
"""

from __future__ import annotations

import collections
import threading
import time

import optree
import pytest
import torch

import dsfunc
from dsfunc.optim import fused
from dsfunc.zero.offload.staging import ShardStaging
from tests.models import mlp_batches, relative_diff
from tests.multiprocess import run_world
from tests.zero.test_offload import host_of, make_state, train


def hold_worker(until: str):
    """Make the background host update wait before it starts: ``"unit"`` until the main thread waits for one
    of its units or the test sets ``.done`` (at most 30 s), ``"pause"`` for 1 s."""
    real = fused.host_adam_

    def held(*args, **kwargs):
        if threading.current_thread().name.startswith("dsfunc-host-update"):
            deadline = time.monotonic() + (30 if until == "unit" else 1)
            while time.monotonic() < deadline and not (until == "unit" and (
                    held.executor.waited_units > held.seen or held.done.is_set())):
                time.sleep(0.001)
            held.seen = held.executor.waited_units
        real(*args, **kwargs)

    held.seen, held.done = 0, threading.Event()
    fused.host_adam_ = held
    return held


def overlapped_and_settled(rank: int, world: int, mode: str, gas: int) -> dict:
    """The same run twice: the next forward overlapping each update (held back until it waits for a unit), and
    every update waited for as soon as its step returns."""
    real = fused.host_adam_
    out = {}
    try:
        for how in ("overlapped", "settled"):
            state = make_state(world, 3, mode, micro=4 // gas, gas=gas, bf16={"enabled": True})
            executor = host_of(state).executor
            held = hold_worker("unit") if how == "overlapped" else None
            if held is not None:
                held.executor = executor
            busy_after_step = []
            n = 4 * world
            for x, y in mlp_batches(4, n):
                state = dsfunc.train_step(state, (x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]))
                busy_after_step.append(executor.in_flight)
                if how == "settled":
                    state.program.run.wait()
            if held is not None:
                held.done.set()  # no next forward will wait for the last update
            fused.host_adam_ = real
            out[how] = {"full": dsfunc.full_params(state), "busy": busy_after_step, "waited": executor.waited_units}
        reference = make_state(world, 3, "none", micro=4 // gas, gas=gas, bf16={"enabled": True})
        out["none"] = dsfunc.full_params(train(reference, rank, world))
    finally:
        fused.host_adam_ = real
    return out


@pytest.mark.parametrize(("world", "mode", "gas"), [(1, "optimizer", 1), (1, "param", 2), (2, "param", 1),
                                                    (2, "optimizer", 2)])
def test_the_next_forward_overlaps_the_host_update_and_trains_bit_for_bit_the_same(world, mode, gas):
    for r in run_world(overlapped_and_settled, world, mode, gas):
        assert r["overlapped"]["busy"] == [True] * 4  # each step returned with its update still running
        assert r["overlapped"]["waited"] >= 3  # and the next forward waited for it unit by unit
        assert relative_diff(r["overlapped"]["full"], r["settled"]["full"]) == 0.0
        assert relative_diff(r["settled"]["full"], r["none"]) < 1e-5


def test_reading_or_flattening_the_state_never_waits_for_the_host_update():
    """The update in flight is the executor's future: reading fields or flattening the state leaves it running
    (held until told), and only the run's wait() waits for it."""
    real = fused.host_adam_
    try:
        state = make_state(1, 3, "optimizer", micro=4, gas=1)
        executor = host_of(state).executor
        held = hold_worker("unit")
        held.executor = executor
        state = dsfunc.train_step(state, mlp_batches(1, 4)[0])
        assert executor.in_flight
        dict(state.params), state.opt_state, optree.tree_leaves(state)  # reads that must not wait
        assert executor.in_flight and executor.waited_units == 0
        held.done.set()
        state.program.run.wait()
        assert not executor.in_flight
        after = {name: p.clone() for name, p in state.params.items()}
        fused.host_adam_ = real
        reference = dsfunc.train_step(make_state(1, 3, "optimizer", micro=4, gas=1), mlp_batches(1, 4)[0])
        reference.program.run.wait()
        assert relative_diff(after, dict(reference.params)) == 0.0
    finally:
        fused.host_adam_ = real


def test_a_failure_in_the_host_update_is_raised_by_what_comes_next():
    real = fused.host_adam_

    def failing(*args, **kwargs):
        if threading.current_thread().name.startswith("dsfunc-host-update"):
            raise RuntimeError("host update broke")
        real(*args, **kwargs)

    try:
        for read in ("step", "wait"):
            state = make_state(1, 3, "optimizer", micro=4, gas=1)
            fused.host_adam_ = failing
            state = dsfunc.train_step(state, mlp_batches(1, 4)[0])
            fused.host_adam_ = real
            with pytest.raises(RuntimeError, match="host update broke"):
                if read == "step":
                    dsfunc.train_step(state, mlp_batches(1, 4)[0])  # its forward waits for a unit first
                else:
                    state.program.run.wait()
            assert not host_of(state).executor.in_flight
    finally:
        fused.host_adam_ = real
    assert torch.is_tensor(next(iter(state.params.values())))  # the error was raised once, not forever


def copies_per_step(rank: int, world: int, gas: int) -> dict:
    """How often each unit's 16-bit shard is cast on the host (``stage``) and copied to the device (``send``)
    during one step after the first, counted on the real :class:`ShardStaging` (its methods still run)."""
    tally: collections.Counter = collections.Counter()
    lock = threading.Lock()  # the background update stages and sends too

    def counted(kind: str):
        real = getattr(ShardStaging, kind)

        def count(self, unit, *args, **kwargs):
            with lock:
                tally[kind, unit.name] += 1
            return real(self, unit, *args, **kwargs)

        return count

    real = {kind: getattr(ShardStaging, kind) for kind in ("stage", "send")}
    out = {}
    try:
        for kind in real:
            setattr(ShardStaging, kind, counted(kind))
        for stage, mode in ((1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "param")):
            state = make_state(world, stage, mode, micro=4 // gas, gas=gas, bf16={"enabled": True})
            for x, y in mlp_batches(2, 4 * world):
                state.program.run.wait()
                tally.clear()  # the first step builds the copies: the second is the one counted
                state = dsfunc.train_step(state, (x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]))
                state.program.run.wait()
            workspace = state.program.run.workspace
            out[stage, mode] = {"counts": dict(tally), "units": [u.name for u in workspace.plan.units],
                                "lazy": {u.name for u in workspace.plan.units if workspace.lazy(u)}}
    finally:
        for kind, method in real.items():
            setattr(ShardStaging, kind, method)
    return out


@pytest.mark.parametrize(("world", "gas"), [(1, 1), (2, 2)])  # the shard written over the gradient; a buffer
def test_the_update_sends_each_units_new_shard_to_the_device_once(world, gas):
    """The host update writes each unit's new 16-bit shard itself and sends it as the unit is done; the refresh
    after the update (and the background's) must not cast or send the units again. With ``offload_param`` each
    gather streams the host shard in besides: the forward's and the backward's of each micro-batch."""
    for r in run_world(copies_per_step, world, gas):
        for (stage, mode), got in r.items():
            streamed = {n: 2 * gas for n in got["lazy"]} if mode == "param" else {}
            expected = {("send", n): streamed.get(n, 1) for n in got["units"]}
            assert got["counts"] == expected, (stage, mode)
