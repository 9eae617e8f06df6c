"""Backward by units: one joint backward for several micro-batches, unit by unit from the last to the first.

[Note: backward by units] With gradient accumulation each micro-batch's backward follows its forward, so a unit's
gradient sum is added to once a micro-batch, by a backward that goes through every unit. Where the sums live in
host memory (ZeRO-Offload) each addition brings the sum back over PCIe and sends it out again: 8 bytes a parameter
a micro-batch, more than a large model's backward computes in the time. Here the forwards of a joint backward's
micro-batches run first, each unit call's inputs cut from the graph before it (a detached leaf stands in for each
input that needs a gradient: :func:`cut_inputs`). The backward then goes segment by segment: from the losses back
to the last unit call's inputs, then from each call's inputs back to the call before it, each segment for every
micro-batch of the joint backward in turn before the next segment. A unit's gradients of those micro-batches thus
come one after another, and its sum stays on the device from one to the next (``Reducer.add(followed=True)``): it
crosses PCIe once a joint backward. A stage-3 unit is gathered once for it, too.

Each micro-batch's gradient of a unit is the one its own backward makes, added into the sum in the same order as
before, so training is bit for bit the same wherever a unit's parameters are reached by one segment of a
micro-batch, as a unit module's are. The root unit's are reached twice when it holds both the embedding and the
output projection: its two parts then add in fp32, where one backward would have added them in the compute dtype.

What it needs: the units form a chain. The input of a unit call is backpropagated once, after every call that
read it (one tensor passed to several units, as a decoder's encoder output, is fine), so a tensor that the units
pass on must reach the loss through unit inputs only: not also by a skip around a unit, or as a hidden state the
model returns. Such a tensor's gradient would come from two segments, and the runtime refuses it with an error as
it happens. What it costs: the joint backward's forwards hold their saved activations at once (with activation
checkpointing, each unit's inputs), and each unit is recomputed for one micro-batch after another.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

from dsfunc.errors import InputError

# one unit call's inputs that need a gradient, each with the detached leaf the call got in its place
Call = list[tuple[torch.Tensor, torch.Tensor]]
Segment = Callable[["DeferredMicro", list[torch.Tensor], list[torch.Tensor]], None]
HeldSegment = Callable[["DeferredMicro", list[torch.Tensor], list[torch.Tensor], bool], None]


@dataclasses.dataclass(eq=False)
class DeferredMicro:
    """A micro-batch whose forwards ran and whose backward waits for the joint one: what the runtime bound for it."""

    micro: tuple[int, int]
    losses: list[torch.Tensor]
    seeds: list[torch.Tensor]
    leaves: list[torch.Tensor]
    unit_leaves: list[Any]
    order: list[str]
    calls: list[Call]

    def cut_leaves(self) -> list[torch.Tensor]:
        return [leaf for call in self.calls for _, leaf in call]


class JointBackward:
    """A runtime's micro-batches whose backward waits to run jointly, ``size`` at most, and the state of the
    joint backward that the runtime reads: :attr:`followed` and the :attr:`roots` of the running segment."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls: list[Call] = []  # the open micro-batch's unit calls, their inputs cut
        self.losses: list[tuple[torch.Tensor, torch.Tensor]] = []  # its losses and their seeds, not yet run
        self.waiting: list[DeferredMicro] = []
        self.followed = False  # the running segment is followed by another micro-batch's through the same units
        self.roots: set[int] | None = None  # ids of the tensors the running segment starts from

    def on(self, micro: tuple[int, int]) -> bool:
        """Whether micro-batch ``micro``'s backward waits for the joint one."""
        return self.size > 1 and micro[1] > 1

    def cut(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """A unit call's arguments with its inputs cut from the graph (:func:`cut_inputs`), each input checked to
        get its gradient only as the root of its own segment."""
        args, kwargs, call = cut_inputs(args, kwargs)
        me = weakref.ref(self)
        for t, _ in call:
            key = id(t)
            t.register_hook(lambda g, key=key: me()._check_root(key))
        self.calls.append(call)
        return args, kwargs

    def defer(self, micro: tuple[int, int], leaves: list[torch.Tensor], unit_leaves: list[Any],
              order: list[str]) -> None:
        """Close the open micro-batch: it waits for the joint backward when it has losses."""
        if self.losses:
            losses, seeds = (list(x) for x in zip(*self.losses))
            self.waiting.append(DeferredMicro(micro, losses, seeds, leaves, unit_leaves, order, self.calls))
        self.calls, self.losses = [], []

    def due(self, micro: tuple[int, int]) -> bool:
        """Whether the joint backward runs now, after micro-batch ``micro``: ``size`` micro-batches wait, or it was the
        step's last."""
        return bool(self.waiting) and (len(self.waiting) >= self.size or micro[0] == micro[1] - 1)

    def run(self, segment: Segment) -> DeferredMicro:
        """The waiting micro-batches' backward, through ``segment`` (:func:`backward_by_units`); the last of them."""
        micros, self.waiting = self.waiting, []

        def step(d: DeferredMicro, roots: list[torch.Tensor], grads: list[torch.Tensor], followed: bool) -> None:
            self.followed, self.roots = followed, {id(t) for t in roots}
            segment(d, roots, grads)

        try:
            backward_by_units(micros, step)
        finally:
            self.followed, self.roots = False, None
        return micros[-1]

    def _check_root(self, key: int) -> None:
        if self.roots is None or key not in self.roots:
            raise InputError(
                f"offload_optimizer.micro_batches_per_backward = {self.size}: a tensor that a unit takes as input "
                "also reaches the loss another way (a skip connection around a unit, or a hidden state the model "
                "returns), so the backward by units would take its gradient from two places. Set "
                "micro_batches_per_backward to 1 for this model."
            )


def cut_inputs(args: Any, kwargs: Any) -> tuple[Any, Any, Call]:
    """``args`` and ``kwargs`` of a unit call with each tensor that needs a gradient replaced by a leaf detached
    from it, and the pairs (input, leaf)."""
    call: Call = []

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            return t
        leaf = t.detach().requires_grad_()
        call.append((t, leaf))
        return leaf

    args, kwargs = optree.tree_map(cut, (args, kwargs))
    return args, kwargs, call


def backward_by_units(micros: list[DeferredMicro], segment: HeldSegment) -> None:
    """Backpropagate ``micros``' losses segment by segment, from the last unit call to the first.

    ``segment(micro, roots, grads, followed)`` runs one micro-batch's backward from ``roots`` (seeded with ``grads``) to
    its leaves; ``followed`` says the next segment is another micro-batch's through the same units.
    """
    _each(segment, [(d, d.losses, d.seeds) for d in micros])
    firsts = [{id(t): c for c in reversed(range(len(d.calls))) for t, _ in d.calls[c]} for d in micros]
    waiting: list[dict[int, list[Any]]] = [{} for _ in micros]  # id(input) -> [input, its gradient so far]
    for c in reversed(range(max(len(d.calls) for d in micros))):
        work = []
        for d, first, sums in zip(micros, firsts, waiting):
            if c >= len(d.calls):
                continue
            for t, leaf in d.calls[c]:
                if leaf.grad is not None:
                    entry = sums.setdefault(id(t), [t, None])
                    entry[1] = leaf.grad if entry[1] is None else entry[1] + leaf.grad
                    leaf.grad = None
            ready = [sums.pop(key) for key in [key for key in sums if first[key] == c]]
            if ready:  # an input is backpropagated after the last call that read it: at its first
                work.append((d, [t for t, _ in ready], [g for _, g in ready]))
        _each(segment, work)


def _each(segment: HeldSegment, work: list[tuple[DeferredMicro, list[torch.Tensor], list[torch.Tensor]]]) -> None:
    for i, (d, roots, grads) in enumerate(work):
        segment(d, roots, grads, i < len(work) - 1)
