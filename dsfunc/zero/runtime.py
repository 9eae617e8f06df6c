"""The micro-batch runtime: the one implementation of a micro-batch's forward, backward and reduction.

Every caller runs micro-batches through a :class:`MicroBatchRuntime`: the gradient transforms of
:mod:`dsfunc.grad` (``value_and_grad`` inside ``accumulate`` inside ``shard``) and the DeepSpeed engine,
which only translates ``engine(...)``, ``engine.backward(loss)`` and ``engine.step()`` onto
:meth:`~MicroBatchRuntime.forward`, :meth:`~MicroBatchRuntime.backward` and :meth:`~MicroBatchRuntime.end`.
One runtime serves one optimizer step::

    runtime = zero_runtime(state)                      # or local_runtime(state): no collectives
    for i, micro in enumerate(micros):                 # Phase.IDLE
        out = runtime.forward(fn, micro, micro=(i, n))   # -> Phase.FORWARD: parameters bound, fn ran
        runtime.backward(loss_of(out), loss_scale)       # -> Phase.BACKWARD: gradients to the reducer, unbound
        runtime.end()                                    # -> Phase.IDLE: the micro-batch's reductions issued
    loss, grads = runtime.finish()                     # mean loss, this rank's reduced fp32 gradients

The backward seed makes the step's gradient the mean over every micro-batch of every rank:
``loss * loss_scale / ranks / micro_count`` (``ranks`` is the number of ranks the reducer sums over).
``torch.autograd.backward`` is called here and nowhere else.

[Note: lazy binding at stage 3] Units whose compute copy is gathered on demand are bound by the module
hooks (:mod:`dsfunc.zero.hooks`) just before the unit's forward and freed after it; a hook on the
unit's outputs re-gathers it before its backward and prefetches the unit that ran before it.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import optree
import torch
from torch import nn

from dsfunc.errors import InputError, UsageError
from dsfunc.zero.layout import Unit, unit_views
from dsfunc.zero.reduce import Grads, LocalReducer, ZeroReducer

T = TypeVar("T")


class Phase(enum.Enum):
    """Where a runtime is in its current micro-batch."""

    IDLE = enum.auto()  # no micro-batch open: forward() next (or finish())
    FORWARD = enum.auto()  # parameters bound and the forward ran: backward() next
    BACKWARD = enum.auto()  # gradients taken and parameters unbound: end() next


class Reducer(Protocol):
    """What the runtime hands gradients to (:mod:`dsfunc.zero.reduce`)."""

    def add(self, unit: Unit, grad: torch.Tensor, *, last: bool) -> None: ...
    def end_micro(self, *, last: bool) -> None: ...
    def finish(self) -> Grads: ...


class MicroBatchRuntime:
    """Binds a state's parameters into its model for each micro-batch and collects the gradients."""

    def __init__(self, state: Any, reducer: Reducer, *, ranks: int = 1) -> None:
        """``ranks``: how many ranks' gradients ``reducer`` sums (the seed divides by it)."""
        self.state = state
        self.program = state.program
        self.workspace = self.program.workspace
        self.reducer = reducer
        self.ranks = ranks
        self.phase = Phase.IDLE
        self.micro: tuple[int, int] = (0, 1)
        self.leaves: list[torch.Tensor] = []
        self._leaf_of: dict[str, torch.Tensor] = {}
        self._views: dict[str, list[torch.Tensor]] = {}
        self._order: list[str] = []  # lazy units in the order this micro-batch's forward ran them
        self._write_back: Callable[[], None] | None = None
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0

    # -- a micro-batch ------------------------------------------------------------------------------
    def forward(self, fn: Callable[[nn.Module, Any], T], inputs: Any, *, micro: tuple[int, int] = (0, 1)) -> T:
        """Bind the parameters, move ``inputs`` to the device and return ``fn(model, inputs)``.

        ``micro`` is ``(index, count)`` of this micro-batch in the optimizer step: it seeds dropout and
        tells the reducer which micro-batch is the last. If ``fn`` raises, the micro-batch is abandoned
        (everything unbound on this rank) and the error propagates.
        """
        self._expect(Phase.IDLE, "forward")
        inputs = self._to_device(inputs)
        self._bind(micro)
        try:
            with self._rng_scope(micro[0]):
                out = fn(self.program.skeleton, inputs)
        except BaseException:
            self._unbind()
            raise
        self.phase = Phase.FORWARD
        return out

    def backward(self, loss: torch.Tensor, loss_scale: torch.Tensor | float = 1.0, *,
                 retain_graph: bool = False, mean_over_micro: bool = True) -> None:
        """Backpropagate this micro-batch's ``loss``; each unit's gradient goes to the reducer as it is made.

        The seed is ``loss * loss_scale / ranks / micro_count`` (without the micro count when
        ``mean_over_micro`` is false). The parameters are unbound afterwards. If autograd raises, the
        micro-batch is ended and the error propagates.
        """
        self._expect(Phase.FORWARD, "backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise InputError(f"backward() needs a scalar floating-point loss, got {what}")
        if loss.grad_fn is None or not self.leaves:
            raise InputError(
                "the loss has no graph: it does not depend on any trainable parameter bound for this "
                "micro-batch (computed under torch.no_grad(), detached, or from the original module instead "
                "of the model the step binds); compute it from the outputs of this micro-batch's forward"
            )
        seed = loss_scale / self.ranks
        if mean_over_micro:
            seed = seed / self.micro[1]
        try:
            torch.autograd.backward(loss.reshape(()) * seed, inputs=self.leaves, retain_graph=retain_graph)
        except BaseException:
            self._unbind()
            self._end_micro()
            raise
        self._unbind()
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._losses += 1
        self.phase = Phase.BACKWARD

    def end(self) -> None:
        """Let the reducer finish this micro-batch: units no loss reached still join the collectives."""
        self._expect(Phase.BACKWARD, "end")
        self._end_micro()

    def finish(self) -> tuple[torch.Tensor, Grads]:
        """The mean loss of the micro-batches run, and the reduced gradients (after the last ``end``)."""
        self._expect(Phase.IDLE, "finish")
        return self.mean_loss(), self.reducer.finish()

    def mean_loss(self) -> torch.Tensor:
        """The mean loss of the micro-batches run so far."""
        if self._loss_sum is None:
            raise UsageError("no micro-batch has run backward() in this runtime yet")
        return self._loss_sum / self._losses

    def evaluate(self, fn: Callable[[nn.Module, Any], T], inputs: Any) -> T:
        """``fn(model, inputs)`` under ``torch.no_grad()``: an evaluation, bound and unbound around it."""
        self._expect(Phase.IDLE, "evaluate")
        inputs = self._to_device(inputs)
        with torch.no_grad():
            self._bind((0, 1))
            try:
                with self._rng_scope(0):
                    return fn(self.program.skeleton, inputs)
            finally:
                self._unbind()

    # -- binding -------------------------------------------------------------------------------------
    def _bind(self, micro: tuple[int, int]) -> None:
        self.micro = micro
        self.workspace.active = self
        self.leaves, self._leaf_of, self._views, self._order = [], {}, {}, []
        for unit in self.program.plan.units:
            if not self.workspace.lazy(unit):
                self._bind_unit(unit)
        self._write_back = self.program.slots.bind_buffers(self.state.buffers, self.program.compute_dtype)

    def _unbind(self) -> None:
        """Restore the skeleton's placeholders, write buffers back, free lazy units: on this rank only."""
        self.program.slots.restore()
        self.workspace.active = None
        self._leaf_of, self._views = {}, {}
        self.workspace.release_all()
        if self._write_back is not None:
            self._write_back()
            self._write_back = None

    def _end_micro(self) -> None:
        index, count = self.micro
        self.reducer.end_micro(last=index == count - 1)
        self.phase = Phase.IDLE

    def _bind_unit(self, unit: Unit) -> None:
        """Make ``unit``'s parameters visible to the skeleton as views of a fresh autograd leaf."""
        if unit.name in self._leaf_of:
            self.program.slots.bind_unit(unit.name, self._views[unit.name])
            return
        flat = self.workspace.ensure(unit, self.state.params)
        leaf = flat.detach().requires_grad_()
        me = weakref.ref(self)  # weak: a cycle leaf -> hook -> runtime -> leaf would keep whole states alive
        leaf.register_post_accumulate_grad_hook(lambda t, u=unit: me()._on_grad(u, t))
        self._leaf_of[unit.name] = leaf
        self.leaves.append(leaf)
        views = unit_views(unit, leaf)
        self._views[unit.name] = views
        self.program.slots.bind_unit(unit.name, views)

    def _on_grad(self, unit: Unit, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        index, count = self.micro
        self.reducer.add(unit, grad, last=index == count - 1)
        if self.workspace.lazy(unit):
            self.workspace.release(unit)

    # -- stage-3 module hooks (see [Note: lazy binding at stage 3]) -------------------------------------
    def unit_forward_begins(self, unit: Unit) -> None:
        if unit.name not in self._order:
            self._order.append(unit.name)
        self.workspace.ensure(unit, self.state.params)  # a unit run twice in one forward is re-gathered
        self._bind_unit(unit)
        self.workspace.prefetch(self.workspace.next_units(unit), self.state.params)

    def unit_forward_ends(self, unit: Unit, output: Any) -> None:
        self.workspace.release(unit)
        me = weakref.ref(self)
        for t in optree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, u=unit: me()._unit_backward_begins(u, g))

    def _unit_backward_begins(self, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        self.workspace.ensure(unit, self.state.params)
        i = self._order.index(unit.name)
        if i > 0:
            self.workspace.prefetch([self.program.plan.unit(self._order[i - 1])], self.state.params)
        return grad

    # -- helpers -------------------------------------------------------------------------------------
    def _expect(self, phase: Phase, call: str) -> None:
        if self.phase is not phase:
            raise UsageError(f"micro-batch runtime: {call}() in phase {self.phase.name}, expected {phase.name}")

    def _to_device(self, inputs: Any) -> Any:
        device = self.program.device
        return optree.tree_map(
            lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, inputs
        )

    @contextlib.contextmanager
    def _rng_scope(self, micro: int) -> Iterator[None]:
        """Seed dropout from (seed, step, micro-batch, rank) so a resumed run draws the same masks."""
        device = self.program.device
        cuda = device.type == "cuda"
        if cuda and torch.cuda.is_current_stream_capturing():  # a graphed step seeds per step (dsfunc.graphs)
            yield
            return
        seed = hash((int(self.state.rng[0]), int(self.state.step), micro, self.program.plan.rank)) & 0x7FFF_FFFF_FFFF
        with torch.random.fork_rng(devices=[device] if cuda else []):
            # Seed the generators this step draws from, not torch.manual_seed: that one also seeds every
            # other accelerator type lazily, recording a Python stack each time (half the step on a small
            # model), and would change the other GPUs' streams.
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.default_generators[device.index if device.index is not None else 0].manual_seed(seed)
            yield


def zero_runtime(state: Any) -> MicroBatchRuntime:
    """A runtime whose gradients are reduced over the ranks as the state's ZeRO stage says."""
    program = state.program
    reducer = ZeroReducer(program.plan, comm_dtype=program.comm_dtype, device=program.workspace.device,
                          bucket_size=program.config.zero_optimization.reduce_bucket_size)
    return MicroBatchRuntime(state, reducer, ranks=program.plan.world_size)


def local_runtime(state: Any) -> MicroBatchRuntime:
    """A runtime that keeps this process's gradients (no collective): for unsharded states only."""
    plan = state.program.plan
    if plan.ways != 1:
        raise InputError(
            "value_and_grad without shard() needs unsharded parameters, but this state is sharded "
            f"(ZeRO stage {plan.stage} over {plan.world_size} ranks); wrap it in dsfunc.shard()"
        )
    return MicroBatchRuntime(state, LocalReducer(plan))
