"""Where a step's data and work live: three narrow interfaces, read at fixed points of the step.

As FSDP2's ``OffloadPolicy`` is read at two lifecycle points of an ``FSDPParam``, a step reads these:

* :class:`GradStore` (by the reducer, :mod:`dsfunc.zero.reduce`): where a unit's reduced gradient sum lives
  between micro-batches, and how the next micro-batch gets it back to add to;
* :class:`UpdateRunner` (by :func:`dsfunc.step.apply_gradients`): where the update reads its gradients, who runs
  it, now, in the background or ahead of the step (told the update to expect before backward), and what it
  already wrote of the compute copies;
* :class:`ShardSource` (by the :class:`~dsfunc.zero.gather.Workspace`): where a gather reads this rank's
  compute-dtype shard of a unit.

On the device each is trivial (:class:`DeviceGrads`, :class:`DeviceUpdate`, :class:`DeviceShards`): sums stay
where the reducer made them, the update runs now, the shard is cast from the master. ZeRO-Offload implements
all three in :mod:`dsfunc.zero.offload`; nothing outside that package knows it is there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from dsfunc.optim.update import RUN_NOW, UpdateContext
from dsfunc.zero.layout import Unit

Grads = Mapping[str, torch.Tensor | None]


class GradStore(Protocol):
    """Where a unit's reduced gradient sum waits between micro-batches."""

    off_device: bool  # sums leave the device: the reducer takes each as backward makes it, in its exact dtype
    micro_batches_per_backward: int  # micro-batches whose backward goes through the units together (1: each its own)

    def stays(self, name: str) -> bool:
        """Whether unit ``name``'s sum stays on the device between micro-batches."""
        ...

    def put(self, unit: Unit, grad: torch.Tensor, dtype: torch.dtype, last: bool) -> torch.Tensor:
        """Store ``unit``'s sum so far (``dtype`` holds it exactly; ``last``: the step's last micro-batch) and
        return what :meth:`take` reads it back from."""
        ...

    def take(self, unit: Unit, stored: torch.Tensor) -> torch.Tensor:
        """``unit``'s stored sum back on the compute device in fp32, for the next micro-batch to add to."""
        ...

    def device_bytes(self, kept: int) -> int:
        """Device bytes the sums take at the end of a step, given ``kept``: what they take when all stay there."""
        ...


class DeviceGrads:
    """Every sum stays on the device: the reducer never stores one away."""

    off_device = False
    micro_batches_per_backward = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stays(self, name: str) -> bool:
        return True

    def put(self, unit: Unit, grad: torch.Tensor, dtype: torch.dtype, last: bool) -> torch.Tensor:
        return grad

    def take(self, unit: Unit, stored: torch.Tensor) -> torch.Tensor:
        return stored.to(self.device, torch.float32, non_blocking=True)

    def device_bytes(self, kept: int) -> int:
        return kept


class StepScalars(Protocol):
    """The step's 0-d tensors the update reads (:class:`~dsfunc.optim.update.UpdateContext`'s first fields)."""

    def _asdict(self) -> dict[str, torch.Tensor]: ...


class UpdateRunner(Protocol):
    """Who runs a step's update and where it reads its inputs, read by ``apply_gradients`` top to bottom."""

    def wait(self) -> None:
        """Return once the last step's update, if any still runs, is done (visibly: the step calls it first)."""
        ...

    def expect(self, state: Any, update: Any) -> None:
        """Before the step's backward: ``update`` (an update of :mod:`dsfunc.optim.update`) will be applied to the
        :class:`~dsfunc.TrainState` ``state``; a runner may start it unit by unit as the gradients land, and check
        it when the step's scalars are known."""
        ...

    def collect(self, grads: Grads) -> tuple[Grads, torch.Tensor | None]:
        """The gradients where the update reads them, and their sum of squares if taken on the way (else None)."""
        ...

    def context(self, scalars: StepScalars, lowp: Mapping[str, torch.Tensor], grads: Grads,
                segment_norm: Callable | None, lr: Mapping[str | None, float] | None) -> UpdateContext:
        """The update's context: ``lowp`` are the device's compute-copy slices the update may write."""
        ...

    def written(self, lowp: Mapping[str, torch.Tensor]) -> set[str]:
        """The units whose new compute copy the update has written (or is writing), after it returned."""
        ...

    def launch(self) -> None:
        """Start what the update left for the background (after the workspace has refreshed the rest)."""
        ...

    def host_bytes(self) -> int:
        """Host bytes of its buffers besides the masters and optimizer state (0 on the device)."""
        ...


class DeviceUpdate:
    """The update runs now, where the gradients are, and writes the compute copies it is given."""

    def wait(self) -> None:
        """Nothing runs between steps."""

    def expect(self, state: Any, update: Any) -> None:
        """The update runs when the step's scalars are known, not before."""

    def collect(self, grads: Grads) -> tuple[Grads, torch.Tensor | None]:
        return grads, None

    def context(self, scalars: StepScalars, lowp: Mapping[str, torch.Tensor], grads: Grads,
                segment_norm: Callable | None, lr: Mapping[str | None, float] | None) -> UpdateContext:
        return UpdateContext(**scalars._asdict(), lowp=lowp, segment_norm=segment_norm, executor=RUN_NOW, lr=lr)

    def written(self, lowp: Mapping[str, torch.Tensor]) -> set[str]:
        return set(lowp)

    def launch(self) -> None:
        """Nothing is left for later."""

    def host_bytes(self) -> int:
        return 0


class ShardSource(Protocol):
    """Where a gather reads this rank's compute-dtype shard of a unit."""

    stream: torch.cuda.Stream | None  # where a gather's input is made and sent (None: the current stream)
    derived: bool  # a gathered unit's shard is made when the copies are refreshed: a stale one refreshes first

    def shard(self, unit: Unit, master: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a persistent unit, from its ``master``, on the device in the compute dtype."""
        ...

    @property
    def writing(self) -> bool:
        """Whether the masters may still be written in the background (each unit is waited for as gathered)."""
        ...

    def settle(self) -> bool:
        """Return once nothing writes the masters in the background any more (True if something did)."""
        ...

    def gather_input(self, unit: Unit, master: torch.Tensor) -> torch.Tensor:
        """What a lazy unit's all-gather sends, from its ``master``; :meth:`to_device` then brings it there."""
        ...

    def to_device(self, unit: Unit, src: torch.Tensor) -> torch.Tensor:
        """:meth:`gather_input`'s tensor on the device (run on :attr:`stream`)."""
        ...

    def refresh(self, unit: Unit, master: torch.Tensor) -> None:
        """A lazy unit's ``master`` changed without the update writing its shard: make it again."""
        ...

    def device_elements(self, lazy_shards: int) -> int:
        """Elements kept on the device between gathers, of ``lazy_shards`` (the gathered units' shards)."""
        ...


class DeviceShards:
    """The shard is cast from the master as each gather needs it; nothing is kept between gathers."""

    stream = None
    derived = False
    writing = False

    def __init__(self, compute_dtype: torch.dtype) -> None:
        self.compute_dtype = compute_dtype

    def settle(self) -> bool:
        return False

    def shard(self, unit: Unit, master: torch.Tensor) -> torch.Tensor:
        return master.to(self.compute_dtype)

    def gather_input(self, unit: Unit, master: torch.Tensor) -> torch.Tensor:
        return master.to(self.compute_dtype)

    def to_device(self, unit: Unit, src: torch.Tensor) -> torch.Tensor:
        return src

    def refresh(self, unit: Unit, master: torch.Tensor) -> None:
        """Nothing is kept: the next gather casts the new master."""

    def device_elements(self, lazy_shards: int) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the config puts a run's data and work: the three policies, and where the masters live."""

    grads: GradStore
    shards: ShardSource
    # made with the run's Workspace (which gathers through ``shards``; the runner writes its copies)
    runner: Callable[[Any], UpdateRunner]
    masters: torch.device | None = None  # where the fp32 masters and optimizer state live, if not on the device
    summary: str = ""  # what the startup summary adds about it

    @classmethod
    def on_device(cls, device: torch.device, compute_dtype: torch.dtype) -> Placement:
        """Everything on the compute device."""
        return cls(grads=DeviceGrads(device), shards=DeviceShards(compute_dtype), runner=lambda _workspace: DeviceUpdate())

    def place_master(self, shard: torch.Tensor) -> torch.Tensor:
        """A master ``shard`` as it is materialised, moved where the masters live (pageable: only the host reads
        it there)."""
        if self.masters is None:
            return shard
        return shard.reshape(-1).to(self.masters, copy=True).view(shard.shape)
