"""The DeepSpeed engine's micro-batch runtime: the functional step's (:mod:`dsfunc.zero.runtime`) plus what the
engine's protocol adds to it, a script's own ``loss.backward()`` and the accumulation boundary a client declares.

[Note: a backward the runtime does not run] A script may call ``loss.backward()`` itself. The gradients
still reach the micro-batch's leaves, and the runtime applies the seed there, as each unit's gradient
arrives: ``1 / ranks / micro_count`` (a gradient is linear in the seed, so this is the mean the seed
gives). DeepSpeed scales at the forward's outputs instead, which counts twice an output computed from
another (a Hugging Face output's ``loss`` from its ``logits``). A loss the runtime never sees is not in
the mean loss (``nan`` when no loss of the step was seen). Under fp16 the loss must be multiplied by the
loss scale before its backward (:meth:`EngineRuntime.scale`), so a direct ``loss.backward()`` of an
unscaled loss is an error then.
"""

from __future__ import annotations

from typing import Any

import torch

from dsfunc.batch import scalar_loss
from dsfunc.errors import UsageError
from dsfunc.zero.runtime import MicroBatchRuntime


class EngineRuntime(MicroBatchRuntime):
    """The runtime of an engine's optimizer step: a script may run a backward itself, and may declare where the
    open micro-batch sits in the step."""

    direct_backward = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._declared = False  # place() was called: each backward's loss is a micro-batch's (see place)
        self._prescaled = False  # scale() multiplied a loss by the loss scale for a direct backward

    def place(self, micro: tuple[int, int]) -> None:
        """Move the open micro-batch to ``micro``: its place in the step, declared by the client between its
        forward and its backward (DeepSpeed's ``set_gradient_accumulation_boundary``). The backwards and
        ``end()`` from now on tell the reducer that place, and each backward's loss counts as one micro-batch's
        in :meth:`mean_loss` (such a client runs one micro-batch per backward between its declarations)."""
        self.micro = micro
        self._declared = True

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, for a script that calls ``backward()`` on it itself (fp16)."""
        scalar_loss(loss)
        self._prescaled = True
        return loss * self.state.scaler.scale

    @property
    def micro_backwards(self) -> int:
        """Backwards (the runtime's and the script's own) in the current micro-batch."""
        self.collect()
        return self.tally.backwards

    def _gradient_of_own_backward(self, grad: torch.Tensor) -> torch.Tensor:
        """A unit's gradient from a backward the script called itself, times the seed."""
        if not self._prescaled and not self.program.scaler.unscaled:
            raise UsageError(
                "loss.backward() was called directly, but fp16 training needs the loss multiplied by the "
                "loss scale before its backward; call engine.backward(loss), or engine.scale(loss).backward()"
            )
        self.tally.backwards += 1
        return self.seed(grad, self.micro[1])

    def _losses_in_micro(self) -> int:
        return self.tally.micro_losses if self._declared else 1

    def _end_micro(self) -> None:
        super()._end_micro()
        self._prescaled = False
