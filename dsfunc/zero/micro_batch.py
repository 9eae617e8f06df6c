"""What a micro-batch runtime keeps of the optimizer step it runs: the open micro-batch's binding (:class:`Bound`)
and the counts and losses (:class:`Tally`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from dsfunc.zero.layout import Unit


@dataclasses.dataclass(eq=False)
class Bound:
    """What the open micro-batch bound: its autograd leaves (per unit too), the views the model reads, and how
    buffers are written back."""

    grad: bool = True  # False while an evaluation is bound: views without leaves
    active: bool = False  # parameters bound into the skeleton now
    leaves: list[torch.Tensor] = dataclasses.field(default_factory=list)  # every leaf bound in this micro-batch
    # each bound unit's leaves: its flat leaf, or its resident parameters (a list)
    unit_leaves: list[tuple[Unit, torch.Tensor | list[nn.Parameter]]] = dataclasses.field(default_factory=list)
    views: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    order: list[str] = dataclasses.field(default_factory=list)  # lazy units in the order its forwards ran them
    write_back: Callable[[], None] | None = None

    def reset(self) -> None:
        """Forget the micro-batch's leaves (after it ended or its forwards were dropped)."""
        self.leaves, self.unit_leaves, self.order = [], [], []


@dataclasses.dataclass(eq=False)
class Tally:
    """The step's counts and losses: the open micro-batch's and those of the micro-batches ended."""

    forwards: int = 0  # in the open micro-batch (each draws its own dropout masks)
    backwards: int = 0  # in the open micro-batch: the runtime's and a script's own
    micro_loss: torch.Tensor | None = None  # the sum of the losses backpropagated in the open micro-batch
    micro_losses: int = 0  # losses added into micro_loss
    loss_sum: torch.Tensor | None = None  # over the micro-batches ended
    losses: int = 0  # how many micro-batches' losses loss_sum holds
    micros_ended: int = 0

    def add_loss(self, loss: torch.Tensor) -> None:
        value = loss.detach().float()
        self.micro_loss = value if self.micro_loss is None else self.micro_loss + value
        self.micro_losses += 1

    def end_micro(self, losses: int) -> None:
        """Close the open micro-batch, its loss counting as ``losses`` micro-batches' losses."""
        if self.micro_loss is not None:
            self.loss_sum = self.micro_loss if self.loss_sum is None else self.loss_sum + self.micro_loss
            self.losses += losses
        self.micros_ended += 1
        self.micro_loss, self.micro_losses, self.forwards, self.backwards = None, 0, 0, 0
