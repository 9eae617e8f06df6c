"""The micro-batch runtime: the one implementation of a micro-batch's forward, backward and reduction.

Every caller runs micro-batches through a :class:`MicroBatchRuntime`: the gradient transforms of
:mod:`dsfunc.grad` (``value_and_grad`` inside ``accumulate`` inside ``shard``), a pipeline's schedule
(:meth:`~MicroBatchRuntime.run_backwards`) and the DeepSpeed engine, whose protocol (a script's own backward, the
boundary it declares) :class:`~dsfunc.deepspeed.engine_runtime.EngineRuntime` adds on top.
One runtime serves one optimizer step::

    runtime = zero_runtime(state)                      # or local_runtime(state): no collectives
    for i, micro in enumerate(micros):                 # Phase.IDLE
        out = runtime.forward(fn, micro, micro=(i, n))   # -> Phase.FORWARD: parameters bound, fn ran
        runtime.backward(loss_of(out), loss_scale)       # -> Phase.BACKWARD: gradients to the reducer, unbound
        runtime.end()                                    # -> Phase.IDLE: the micro-batch's reductions issued
    loss, grads = runtime.finish()                     # mean loss, this rank's reduced gradients

A micro-batch may hold several forwards and backwards before ``end()`` (a GAN's discriminator sees a
real and a fake batch; two losses of one forward): a forward in ``FORWARD`` keeps the binding, a forward
in ``BACKWARD`` binds afresh, a backward in ``BACKWARD`` backpropagates another loss of the micro-batch
(a graph kept with ``retain_graph``, or a forward before the last backward). Gradients add up; the
micro-batch's loss is the sum of the losses backpropagated in it, and ``finish()`` returns their mean
over micro-batches. A forward that no backward follows is dropped by ``end()`` or :meth:`drop_forward`.

The backward seed makes the step's gradient the mean over every micro-batch of every rank:
``loss * loss_scale / ranks / micro_count`` (``ranks``: the ranks the reducer's sum is a mean over).
``torch.autograd.backward`` is called here and nowhere else.

A script's own ``loss.backward()`` is the DeepSpeed engine's business ([Note: a backward the runtime does not run] in
:mod:`dsfunc.deepspeed.engine_runtime`, whose runtime extends this one); here a gradient that arrives from a backward
no runtime runs is an error.

[Note: gradients as they come] Where the reducer wants each unit's gradient as backward makes it (its
collective, or its copy to the host, then runs beside the rest of backward: ``Reducer.streams``), a unit is
gathered lazily (freed once its gradient is taken), or the loss is scaled (fp16: a script's own backward of an
unscaled loss is refused as it runs), each leaf gets a post-accumulate-grad hook. Otherwise (one rank, nothing
offloaded, bf16 or fp32) the gradients are taken from the leaves once backward returns, or, after a backward
the script ran itself, the next time the runtime is asked about the micro-batch: a Python hook runs on the
autograd engine's thread, about 40 us a unit on an H200's host, against a few for reading ``leaf.grad``.

[Note: the module's parameters as leaves] Where the gradients are taken after backward and no script runs a
backward itself (everything but the DeepSpeed engine), a unit whose resident parameters already view its compute
copy (:mod:`dsfunc.zero.binding`) is not bound at all: those ``nn.Parameter`` objects are the autograd leaves, as in
a plain PyTorch loop, and each unit's flat gradient is assembled from theirs once backward returns (one ``cat``, as
the backward of a split would make). That spares a split, a view per parameter and their backward nodes per unit
and micro-batch. A resident that is not such a leaf right now (a gradient or a hook of the script's own on it) sends
its unit down the general path: views of one flat leaf, whose gradients never touch the module's parameters. The
engine always takes that path, since between a script's own ``loss.backward()`` and the step its gradients must
not sit on the module's parameters, where the script's own clipping or ``zero_grad()`` would reach them.

[Note: lazy binding at stage 3] Units whose compute copy is gathered on demand are bound by the module
hooks (:mod:`dsfunc.zero.hooks`) just before the unit's forward and freed after it; a hook on the
unit's outputs re-gathers it before its backward and prefetches the unit that ran before it.

With ``micro_batches_per_backward`` > 1 a micro-batch's backward waits until that many micro-batches have run their
forwards, and then goes through them all unit by unit, a joint backward ([Note: backward by units] in
:mod:`dsfunc.zero.backward_by_units`): the unit hooks cut each unit's inputs from the graph in forward, and in backward
the hook on a unit's outputs binds the micro-batch's own views of the unit again, which the unit's recomputed forward
(checkpointing) reads.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import optree
import torch
from torch import nn

from dsfunc.batch import model_inputs, scalar_loss
from dsfunc.errors import InputError, UsageError
from dsfunc.zero.backward_by_units import DeferredMicro, JointBackward
from dsfunc.zero.hooks import tensors_in
from dsfunc.zero.layout import Unit, unit_views
from dsfunc.zero.micro_batch import Bound, Tally
from dsfunc.zero.reduce import Grads, LocalReducer, Reducer, ZeroReducer, sum_dtype
from dsfunc.zero.rng import micro_batch_rng

if TYPE_CHECKING:
    from dsfunc.program import Program
    from dsfunc.state import TrainState
    from dsfunc.zero.gather import Workspace

T = TypeVar("T")

# At most this many gradient elements of several units are assembled by one cat: one launch instead of one a
# unit, while the parameters' own gradients and the assembled copy are both held (see collect)
_ASSEMBLED_ELEMENTS = 1 << 22
_BACKWARDS_RUNNING = [0]  # how many MicroBatchRuntime.backward calls are inside autograd right now


def backward_running() -> bool:
    """Whether a runtime's backward is inside autograd now (else a gradient comes from a script's own)."""
    return _BACKWARDS_RUNNING[0] > 0


class Phase(enum.Enum):
    """Where a runtime is in its current micro-batch."""

    IDLE = enum.auto()  # no micro-batch open: forward() next (or finish())
    FORWARD = enum.auto()  # parameters bound and a forward ran: backward() next (or another forward)
    BACKWARD = enum.auto()  # a backward ran and parameters are unbound: end() next (or another pair)


class MicroBatchRuntime:
    """Binds a state's parameters into its model for each micro-batch and collects the gradients."""

    # a script may call backward() on a loss itself: its gradients must not sit on the module's parameters (see
    # [Note: the module's parameters as leaves]); the engine's runtime says so
    direct_backward = False

    def __init__(self, state: TrainState, reducer: Reducer, *, ranks: int = 1,
                 micro_batches_per_backward: int = 1) -> None:
        """``ranks``: the seed's divisor, which makes the sum over ranks that ``reducer`` takes a mean.
        ``micro_batches_per_backward``: micro-batches whose backward runs together, unit by unit (see [Note:
        backward by units])."""
        self.state = state
        self.program: Program = state.program
        self.reducer = reducer
        self.ranks = ranks
        self.phase = Phase.IDLE
        self.micro: tuple[int, int] = (0, 1)
        self.bound = Bound()
        self.tally = Tally()
        workspace = state.program.run.workspace
        # see [Note: gradients as they come]
        self._streaming = (reducer.streams or any(workspace.lazy(u) for u in state.program.plan.units)
                           or not state.program.scaler.unscaled)
        self.joint = JointBackward(micro_batches_per_backward)  # see [Note: backward by units]

    @property
    def workspace(self) -> Workspace:
        return self.program.run.workspace

    @property
    def leaves(self) -> list[torch.Tensor]:
        """Every autograd leaf bound in the open micro-batch."""
        return self.bound.leaves

    # -- a micro-batch ------------------------------------------------------------------------------
    def forward(self, fn: Callable[[nn.Module, Any], T] | None, inputs: Any, *, micro: tuple[int, int] = (0, 1)) -> T:
        """Bind the parameters, move ``inputs`` to the device and return ``fn(model, inputs)``, or with ``fn``
        None the model's own output for them (:func:`~dsfunc.batch.model_inputs`; called from here, so a batch
        reaches the model through no frame of dsfunc's more).

        ``micro`` is ``(index, count)`` of this micro-batch in the optimizer step: it seeds dropout and
        tells the reducer which micro-batch is the last. If ``fn`` raises, this forward is dropped
        (everything it bound is unbound on this rank) and the error propagates.
        """
        inputs = self._to_device(inputs)
        args, kwargs = model_inputs(inputs) if fn is None else ((), {})
        index = self.tally.forwards
        self.begin_forward(micro)
        model = self.program.skeleton
        try:
            with micro_batch_rng(self.state, micro[0], index):
                out = model(*args, **kwargs) if fn is None else fn(model, inputs)
        except BaseException:
            self.drop_forward()
            raise
        return out

    def begin_forward(self, micro: tuple[int, int] = (0, 1)) -> None:
        """Bind the parameters for a forward the caller runs itself (a call through the model): in
        ``IDLE`` it opens micro-batch ``micro``, in ``BACKWARD`` it binds again for another pair, in
        ``FORWARD`` the binding stays."""
        if self.phase is Phase.IDLE:
            self.micro = micro
        elif micro != self.micro:
            raise UsageError(
                f"micro-batch runtime: a forward for micro-batch {micro} while micro-batch {self.micro} is "
                "open; call end() first"
            )
        if not self.bound.active:
            self._bind(grad=True)
        self.tally.forwards += 1
        self.phase = Phase.FORWARD

    def backward(self, loss: torch.Tensor, loss_scale: torch.Tensor | float = 1.0, *,
                 retain_graph: bool = False, mean_over_micro: bool = True) -> None:
        """Backpropagate ``loss`` (of this micro-batch's forwards); each unit's gradient goes to the
        reducer as it is made.

        The seed is ``loss * loss_scale / ranks / micro_count`` (without the micro count when
        ``mean_over_micro`` is false). The parameters are unbound afterwards. If autograd raises, the
        micro-batch is ended and the error propagates.
        """
        if self.phase is Phase.IDLE:
            self._expect(Phase.FORWARD, "backward")
        scalar_loss(loss)
        if loss.grad_fn is None or not self.leaves:
            raise InputError(
                "the loss has no graph: it does not depend on any trainable parameter bound for this "
                "micro-batch (computed under torch.no_grad(), detached, or from the original module instead "
                "of the model the step binds); compute it from the outputs of this micro-batch's forward"
            )
        seed = self.seed(loss_scale, self.micro[1] if mean_over_micro else 1)
        loss = loss.reshape(())
        # the seed as backward's incoming gradient: the numbers of backpropagating loss * seed, without its two
        # multiplications (forward and backward) and the ones it would be seeded with
        if isinstance(seed, torch.Tensor):
            seed = seed.to(device=loss.device, dtype=loss.dtype).reshape(())
        else:
            seed = torch.full_like(loss, seed)
        if self.joint.on(self.micro):  # it runs in the joint backward (see [Note: backward by units])
            self.joint.losses.append((loss, seed))
            self._unbind()
        else:
            with self._backward_scope():
                torch.autograd.backward(loss, grad_tensors=seed, inputs=self.leaves, retain_graph=retain_graph)
        self.tally.add_loss(loss)
        self.tally.backwards += 1
        self.phase = Phase.BACKWARD

    @contextlib.contextmanager
    def _backward_scope(self) -> Iterator[None]:
        """Around a backward: counted as running (for the reducer's hooks), the parameters unbound after it; a
        failed one also ends the micro-batch."""
        _BACKWARDS_RUNNING[0] += 1
        try:
            yield
            self.collect()
        except BaseException:
            self._unbind()
            self._end_micro()
            raise
        finally:
            _BACKWARDS_RUNNING[0] -= 1
        self._unbind()

    def seed(self, value: torch.Tensor | float, micro_count: int) -> torch.Tensor | float:
        """``value / ranks / micro_count``: the one place the mean over ranks and micro-batches is made. The seed
        :meth:`backward` applies (``value`` the loss scale), what a loss is multiplied by before a backward the
        caller runs in :meth:`run_backwards`, and what a script's own backward's gradients are multiplied by."""
        return _divided(value, self.ranks, micro_count)

    def run_backwards(self, run: Callable[[], torch.Tensor], *, micro: tuple[int, int] = (0, 1)) -> None:
        """Bind the parameters and call ``run()``, which runs forwards and backwards itself (a pipeline
        schedule's, over several micro-batches of its own) on losses already multiplied by :meth:`seed`. Each
        unit's gradient reaches the reducer as in :meth:`backward` and the parameters are unbound after it;
        ``run`` returns the (unseeded, detached) loss to record. ``end()`` comes next."""
        self.begin_forward(micro)
        with self._backward_scope(), micro_batch_rng(self.state, micro[0], 0):
            loss = run()
        self.tally.micro_loss = loss.detach().float()
        self.tally.backwards += 1
        self.phase = Phase.BACKWARD

    def end(self) -> None:
        """Let the reducer finish this micro-batch: units no loss reached still join the collectives.
        A forward after the last backward is dropped."""
        self.collect()
        if self.tally.backwards == 0:
            self._expect(Phase.BACKWARD, "end")
        self._end_micro()

    def drop_forward(self) -> None:
        """Drop the forwards since the last backward (unbound on this rank; nothing reaches the reducer)."""
        self.collect()  # a backward the script ran itself is not dropped with them
        if self.bound.active:
            self._unbind()
        if self.phase is Phase.FORWARD:
            self.phase = Phase.BACKWARD if self.tally.backwards else Phase.IDLE
            if self.phase is Phase.IDLE:
                self.tally.forwards = 0
                self.bound.reset()
                self.joint.calls = []

    @property
    def has_gradients(self) -> bool:
        """True once a backward reached this optimizer step (its gradients would be lost by dropping it)."""
        self.collect()
        return self.tally.backwards > 0 or self.tally.micros_ended > 0

    def finish(self) -> tuple[torch.Tensor, Grads]:
        """The mean loss of the micro-batches run, and the reduced gradients (after the last ``end``)."""
        self._expect(Phase.IDLE, "finish")
        if not self.has_gradients:
            raise UsageError("no micro-batch has run backward() in this runtime yet")
        if self.joint.waiting:  # fewer micro-batches ran than the step has
            self._joint_backward()
        return self.mean_loss(), self.reducer.finish()

    def mean_loss(self) -> torch.Tensor:
        """The mean over micro-batches of the losses backpropagated so far (``nan`` when every backward
        was the script's own, whose loss the runtime never sees)."""
        if self.tally.loss_sum is None:
            if not self.has_gradients:
                raise UsageError("no micro-batch has run backward() in this runtime yet")
            return torch.full((), float("nan"), device=self.program.run.workspace.device)
        return _divided(self.tally.loss_sum, self.tally.losses)

    def evaluate(self, fn: Callable[[nn.Module, Any], T], inputs: Any, *, grad_mode: bool = False) -> T:
        """``fn(model, inputs)`` under ``torch.no_grad()``: an evaluation, bound and unbound around it
        (inside an open forward it runs on that forward's binding). ``grad_mode`` keeps autograd as it is, for a
        function transform (``torch.func.grad``) that differentiates the outputs with respect to the inputs."""
        inputs = self._to_device(inputs)
        with contextlib.nullcontext() if grad_mode else torch.no_grad():
            opened = self.begin_evaluation()
            try:
                with micro_batch_rng(self.state, 0, 0):
                    return fn(self.program.skeleton, inputs)
            finally:
                if opened:
                    self.end_evaluation()

    def begin_evaluation(self) -> bool:
        """Bind the parameters without autograd leaves for an evaluation the caller runs; False (nothing
        to undo) when a forward's binding is already in place."""
        if self.bound.active:
            return False
        self._bind(grad=False)
        return True

    def end_evaluation(self) -> None:
        """Unbind what :meth:`begin_evaluation` bound."""
        self._unbind()

    # -- binding -------------------------------------------------------------------------------------
    def _bind(self, *, grad: bool) -> None:
        self.bound.grad = grad
        self.bound.active = True
        self.program.run.workspace.active = self
        self.bound.views = {}
        for unit in self.program.plan.units:
            if not self.program.run.workspace.lazy(unit):
                self._bind_unit(unit)
        self.bound.write_back = self.program.binding.bind_buffers(self.state.buffers, self.program.compute_dtype)

    def _unbind(self) -> None:
        """Put the skeleton's resident tensors back, write buffers back, free lazy units: on this rank only."""
        self.program.binding.restore(self.state.buffers)
        self.program.run.workspace.active = None
        self.bound.active = False
        self.bound.views = {}
        self.program.run.workspace.release_all()
        if self.bound.write_back is not None:
            self.bound.write_back()
            self.bound.write_back = None

    def _end_micro(self) -> None:
        self.collect()  # what a backward the script ran itself left in the leaves
        if self.bound.active:
            self._unbind()
        index, count = self.micro
        if self.joint.losses:  # its backward runs in the joint one
            self.joint.defer(self.micro, self.bound.leaves, self.bound.unit_leaves, self.bound.order)
        else:
            self.reducer.end_micro(last=index == count - 1)
        if self.joint.due(self.micro):
            self._joint_backward()
        self.tally.end_micro(self._losses_in_micro())
        self.bound.reset()
        self.phase = Phase.IDLE

    def _losses_in_micro(self) -> int:
        """How many micro-batches' losses the open micro-batch's loss counts as in :meth:`mean_loss`."""
        return 1

    def _bind_unit(self, unit: Unit) -> None:
        """Make ``unit``'s parameters visible to the skeleton: views of a fresh autograd leaf (a training
        binding) or of the compute copy itself (an evaluation); or, where they can be the leaves, its resident
        parameters as they are ([Note: the module's parameters as leaves])."""
        bound = self.bound
        if unit.name in bound.views:
            self.program.binding.bind_unit(unit.name, bound.views[unit.name])
            return
        flat = self.program.run.workspace.ensure(unit, self.state.params)
        if bound.grad:
            params = self._resident_leaves(unit, flat)
            if params is not None:
                bound.leaves.extend(params)
                bound.unit_leaves.append((unit, params))
                return
            flat = flat.detach().requires_grad_()
            if self._streaming:
                me = weakref.ref(self)  # weak: a cycle leaf -> hook -> runtime -> leaf would keep whole states alive
                flat.register_post_accumulate_grad_hook(lambda t, u=unit: me()._on_grad(u, t))
            bound.leaves.append(flat)
            bound.unit_leaves.append((unit, flat))
        views = unit_views(unit, flat)
        bound.views[unit.name] = views
        self.program.binding.bind_unit(unit.name, views)

    def _resident_leaves(self, unit: Unit, flat: torch.Tensor) -> list[nn.Parameter] | None:
        """The unit's resident parameters when they can be its autograd leaves: they view ``flat``, which they fill
        (no padding to assemble), and hold no gradient or hook of the script's own."""
        if (self._streaming or self.direct_backward or flat.numel() != unit.numel
                or not self.program.run.workspace.shows(unit, flat)):
            return None
        params = self.program.binding.residents(unit.name)
        for p in params:
            if (not isinstance(p, nn.Parameter) or not p.requires_grad or not p.is_leaf or p.grad is not None
                    or p._backward_hooks or p._post_accumulate_grad_hooks):
                return None
        return params

    def collect(self) -> None:
        """Hand the reducer the gradients left in the leaves (when it does not take them as they come), last bound
        first: the order backward finishes a chain of units in, which hooks would have given. The reducer keeps
        that order, and the norm sums in it, so a run trains bit for bit the same either way."""
        if self._streaming or all(leaf.grad is None for leaf in self.bound.leaves):  # (called after every phase)
            return
        batch: list[tuple[Unit, list[torch.Tensor]]] = []  # units whose gradients are assembled by one cat
        elements = 0  # in batch
        for unit, leaves in reversed(self.bound.unit_leaves):
            if isinstance(leaves, torch.Tensor):
                self._hand_assembled(batch)
                if leaves.grad is not None:
                    self._on_grad(unit, leaves)
                continue
            pieces = self._take_param_grads(unit, leaves)
            if pieces is None:
                continue
            if batch and elements + unit.numel > _ASSEMBLED_ELEMENTS:
                self._hand_assembled(batch)
                elements = 0
            batch.append((unit, pieces))
            elements += unit.numel
        self._hand_assembled(batch)

    def _take_param_grads(self, unit: Unit, params: list[nn.Parameter]) -> list[torch.Tensor] | None:
        """The pieces of the unit's flat gradient, taken off its parameters (zeros for one no loss reached); None
        when no loss reached the unit."""
        grads = [p.grad for p in params]
        if all(g is None for g in grads):
            return None
        for p in params:
            p.grad = None
        return [g.reshape(-1) if g is not None else p.new_zeros(p.numel()) for p, g in zip(params, grads)]

    def _hand_assembled(self, batch: list[tuple[Unit, list[torch.Tensor]]]) -> None:
        """Hand over the flat gradients of the units in ``batch``, assembled by one ``cat`` for them all (each
        unit's a slice of it; one launch, not one per unit), and empty ``batch``."""
        if not batch:
            return
        pieces = [p for _, ps in batch for p in ps]
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        for (unit, _), grad in zip(batch, flat.split([unit.numel for unit, _ in batch])):
            self._hand(unit, grad)
        batch.clear()

    def _on_grad(self, unit: Unit, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        self._hand(unit, grad)
        # unless the next micro-batch's backward reads it
        if self.program.run.workspace.lazy(unit) and not self.joint.followed:
            self.program.run.workspace.release(unit)

    def _hand(self, unit: Unit, grad: torch.Tensor) -> None:
        """Give the reducer ``unit``'s gradient of this micro-batch."""
        if not backward_running():
            grad = self._gradient_of_own_backward(grad)
        index, count = self.micro
        self.reducer.add(unit, grad, last=index == count - 1, followed=self.joint.followed)

    def _gradient_of_own_backward(self, grad: torch.Tensor) -> torch.Tensor:
        """A unit's gradient from a backward no runtime ran (a script's own ``loss.backward()``), as it goes to the
        reducer: only the engine's runtime takes those (:mod:`dsfunc.deepspeed.engine_runtime`)."""
        raise UsageError(
            "a gradient reached this micro-batch's parameters from a backward the runtime did not run (a "
            "loss.backward() in loss_fn?); return the loss instead: the step runs its backward"
        )

    # -- unit module hooks (see [Note: lazy binding at stage 3]) ---------------------------------------
    def unit_forward_begins(self, unit: Unit, args: Any = (), kwargs: Any = None) -> tuple[Any, Any] | None:
        """Before a unit module's forward: a lazy unit gathered and bound; in a joint backward, the call's inputs
        cut from the graph (the new ``(args, kwargs)`` are returned)."""
        if self.program.run.workspace.lazy(unit):
            if self.bound.grad and unit.name not in self.bound.order:
                self.bound.order.append(unit.name)
            self.program.run.workspace.ensure(unit, self.state.params)  # a unit run twice in one forward is re-gathered
            self._bind_unit(unit)
            self.program.run.workspace.prefetch(self.program.run.workspace.next_units(unit), self.state.params)
        if not (self.bound.grad and self.joint.on(self.micro)):
            return None
        return self.joint.cut(args, kwargs or {})

    def unit_forward_ends(self, unit: Unit, output: Any) -> None:
        """After a unit module's forward: a lazy unit freed, and a hook on its outputs for its backward."""
        lazy, joint = self.program.run.workspace.lazy(unit), self.bound.grad and self.joint.on(self.micro)
        if lazy:
            self.program.run.workspace.release(unit)
        if not (lazy or joint):
            return
        views = self.bound.views.get(unit.name) if joint else None
        me = weakref.ref(self)
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(lambda g, u=unit, v=views: me()._unit_backward_begins(u, g, v))

    def _unit_backward_begins(self, unit: Unit, grad: torch.Tensor,
                              views: list[torch.Tensor] | None = None) -> torch.Tensor:
        if views is not None:  # joint: the unit's recomputed forward reads this micro-batch's own views
            self.program.binding.bind_unit(unit.name, views)
        if not self.program.run.workspace.lazy(unit):
            return grad
        self.program.run.workspace.ensure(unit, self.state.params)
        order = self.bound.order
        i = order.index(unit.name) if unit.name in order else 0
        if i > 0:
            self.program.run.workspace.prefetch([self.program.plan.unit(order[i - 1])], self.state.params)
        return grad

    # -- backward by units (see [Note: backward by units]) ---------------------------------------------
    def _joint_backward(self) -> None:
        """The waiting micro-batches' backward, unit by unit; then the reducer ends them."""
        _BACKWARDS_RUNNING[0] += 1
        try:
            index, count = self.joint.run(self._segment).micro
        finally:
            _BACKWARDS_RUNNING[0] -= 1
            self.program.binding.restore(self.state.buffers)  # the views the segments bound
            self.program.run.workspace.release_all()
        self.reducer.end_micro(last=index == count - 1)

    def _segment(self, d: DeferredMicro, roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Micro-batch ``d``'s backward from ``roots`` to its leaves and to the unit inputs cut in its forward."""
        self.micro = d.micro
        self.bound.leaves, self.bound.unit_leaves, self.bound.order = d.leaves, d.unit_leaves, d.order
        torch.autograd.backward(roots, grad_tensors=grads, inputs=d.leaves + d.cut_leaves())
        self.collect()

    # -- helpers -------------------------------------------------------------------------------------
    def _expect(self, phase: Phase, call: str) -> None:
        if self.phase is not phase:
            raise UsageError(f"micro-batch runtime: {call}() in phase {self.phase.name}, expected {phase.name}")

    def _to_device(self, inputs: Any) -> Any:
        device = self.program.device
        return optree.tree_map(
            lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, inputs
        )


def _divided(value: torch.Tensor | float, *divisors: int) -> torch.Tensor | float:
    """``value`` divided by each divisor in turn, skipping those that are 1 (the result is the same, without a
    device op per step)."""
    for d in divisors:
        if d != 1:
            value = value / d
    return value


R = TypeVar("R", bound=MicroBatchRuntime)


def zero_runtime(state: TrainState, kind: type[R] = MicroBatchRuntime) -> R:
    """A runtime of class ``kind`` whose gradients are reduced over the ranks as the state's ZeRO stage says."""
    program = state.program
    run = program.run
    reducer = ZeroReducer(program.plan, comm_dtype=program.comm_dtype, device=run.workspace.device,
                          bucket_size=program.config.zero_optimization.reduce_bucket_size, store=run.grads,
                          narrow=program.update.reads_16_bit_grads, sums=sum_dtype(program.config))
    per_backward = 1 if kind.direct_backward else run.grads.micro_batches_per_backward
    # the seed's 1/ranks makes the reducer's sum a mean over dp (the sp ranks' gradients add up where DeepSpeed's do:
    # [Note: the gradient over sp] in dsfunc.distributed.mesh); gradient_allreduce_op "sum" keeps the sum
    summed = 1 if program.mesh is None else program.mesh.sp_summed(program.plan.stage)
    ranks = 1 if program.config.gradient_allreduce_op == "sum" else program.plan.world_size // summed
    return kind(state, reducer, ranks=ranks, micro_batches_per_backward=per_backward)


def local_runtime(state: TrainState) -> MicroBatchRuntime:
    """A runtime that keeps this process's gradients (no collective): for unsharded states only."""
    plan = state.program.plan
    if plan.ways != 1:
        raise InputError(
            "value_and_grad without shard() needs unsharded parameters, but this state is sharded "
            f"(ZeRO stage {plan.stage} over {plan.world_size} ranks); wrap it in dsfunc.shard()"
        )
    return MicroBatchRuntime(state, LocalReducer(plan, narrow=state.program.update.reads_16_bit_grads,
                                                     sums=sum_dtype(state.program.config)))
