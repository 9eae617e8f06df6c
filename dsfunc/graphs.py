"""The whole step as one CUDA graph: replayed, it costs no Python at all (opt-in, static shapes).

A step of dsfunc issues no host sync, so once its shapes are known it can be captured: forward, backward,
the reductions, the norm and overflow check, the fused update and the loss scaler become one
``torch.cuda.CUDAGraph`` that each later step replays after copying its batch into the graph's input.
Turned on by ``"compile": {"cuda_graph": true}`` (or ``init_state(compile={"cuda_graph": True})``).

[Note: a graphed step's state] The graph reads the state's tensors at the addresses it was captured with
and writes its results where the captured step wrote them. Parameters and moments are updated in place
already; the few small tensors a step makes anew (counters, loss-scaler state, metrics) are copied back
into the input state's tensors after each replay, so every graphed step takes and returns states that
share all their tensors (the donation ``train_step`` does anyway). The CPU step counter is advanced on the
host. Dropout draws from the CUDA generator, which the graph reads at each replay: it is seeded per step
from (seed, step), so a graphed run is reproducible and resumable, but its masks are not the eager
run's (which are seeded per micro-batch). The min-loss-scale check runs outside the graph.

Falls back to the eager step, with one log line saying why, where a graph cannot hold the step: not on
CUDA, ZeRO-3 (it frees and re-gathers storage inside the step), the optimizer offloaded (its update runs
on the CPU), several processes on gloo, or ``donate=False``. A batch of other shapes or dtypes is captured
anew (after two warm-up steps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import optree
import torch

from dsfunc.errors import UsageError
from dsfunc.state import TrainState

logger = logging.getLogger("dsfunc")

StepFn = Callable[[TrainState, Any, bool], TrainState]
WARMUP_STEPS = 2  # eager steps before a capture: CUDA libraries allocate their workspaces here


class GraphedStep:
    """``step(state, batch, donate)`` that replays a captured CUDA graph of ``step_fn`` where it can."""

    def __init__(self, step_fn: StepFn, before_step: Callable[[TrainState], None],
                 after_step: Callable[[TrainState], None]) -> None:
        self.step_fn = step_fn
        # host work that must not be captured: the min-loss-scale check of the state given, and its start
        self.before_step, self.after_step = before_step, after_step
        self.key: Any = None
        self.warm = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.fallback_logged = False

    def __call__(self, state: TrainState, batch: Any, donate: bool = True) -> TrainState:
        reason = _why_not(state, donate)
        if reason is not None:
            if not self.fallback_logged:
                logger.warning("dsfunc: compile.cuda_graph is on, but this step runs eagerly: %s", reason)
                self.fallback_logged = True
            return self.step_fn(state, batch, donate)
        key = _signature(batch)
        if key != self.key:
            self.key, self.warm, self.graph = key, 0, None
        if self.graph is None and self.warm < WARMUP_STEPS:
            self.warm += 1
            side = torch.cuda.Stream()  # warm-ups on a side stream, as torch.cuda.graph's docs ask
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                new = self.step_fn(state, batch, donate)
            torch.cuda.current_stream().wait_stream(side)
            return new
        self.before_step(state)
        if self.graph is None:
            self._capture(state, batch)
        return self._replay(state, batch)

    def _capture(self, state: TrainState, batch: Any) -> None:
        device = state.program.device
        self.batch = optree.tree_map(lambda t: _static_copy(t, device) if isinstance(t, torch.Tensor) else t, batch)
        self.inputs, self.treedef = optree.tree_flatten(state)
        self.graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph):
            out = self.step_fn(state, self.batch, True)
        self.outputs, _ = optree.tree_flatten(out)
        logger.info("dsfunc: captured the step as a CUDA graph for batch shapes %s", self.key)

    def _replay(self, state: TrainState, batch: Any) -> TrainState:
        leaves = optree.tree_leaves(state)  # flattening reads even a donated state (the capture donated it)
        if any(a is not b for a, b in zip(leaves[1:], self.inputs[1:])):  # leaf 0 is the CPU step counter
            raise UsageError(
                "a graphed step (compile.cuda_graph) must be given the state the previous step returned; "
                "for another state, build it with its own dsfunc.init_state"
            )
        optree.tree_map(lambda static, new: static.copy_(new, non_blocking=True) if isinstance(static, torch.Tensor)
                        else None, self.batch, batch)
        current = optree.tree_unflatten(self.treedef, leaves)
        step = int(current.step)
        generator = torch.cuda.default_generators[current.program.device.index or 0]
        generator.manual_seed(hash((int(current.rng[0]), step)) & 0x7FFF_FFFF_FFFF)
        self.graph.replay()
        for into, out in zip(self.inputs[1:], self.outputs[1:]):
            if out is not into:
                into.copy_(out)
        state.mark_donated()
        new = current.replace(step=torch.tensor(step + 1, dtype=torch.int64))
        self.inputs = optree.tree_leaves(new)
        self.after_step(new)
        return new


def _static_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The graph's own copy of a batch tensor, with ``t``'s strides where they do not overlap: a compiled forward
    guards on its inputs' strides (``tokens[:, :-1]`` has a row stride one more than its width), so a
    contiguous copy would make it compile anew inside the capture, which cannot be done."""
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        return t.detach().to(device).clone()
    static = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return static.copy_(t.detach())


def _why_not(state: TrainState, donate: bool) -> str | None:
    program = state.program
    if program.device.type != "cuda":
        return f"the state lives on {program.device}, not a CUDA device"
    if program.plan.stage == 3:
        return "ZeRO-3 frees and re-gathers parameter storage inside the step"
    if program.run.placement.masters is not None:
        return "the optimizer is offloaded: the update runs on the CPU, outside any CUDA graph"
    if program.plan.world_size > 1 and torch.distributed.get_backend() != "nccl":
        return "several processes on a backend other than NCCL"
    if not donate:
        return "donate=False (a graph writes into the state it was captured with)"
    return None


def _signature(batch: Any) -> Any:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in optree.tree_leaves(batch)
                 if isinstance(t, torch.Tensor))


