"""Where a gather reads its shard with the optimizer offloaded: ZeRO-Offload's :class:`~dsfunc.zero.policy.ShardSource`.

The masters are in host memory, so each compute copy is built from the unit's compute-dtype shard staged on the
host (:mod:`dsfunc.zero.offload.staging`) and copied to the device. A lazy (stage-3) unit then keeps that device
shard between gathers, so a gather costs no host-to-device copy, unless the parameters are offloaded too
(``offload_param``), when each gather streams it from the host again, on a stream of its own beside the kernels.
"""

from __future__ import annotations

import torch

from dsfunc.zero.layout import Unit
from dsfunc.zero.offload.executor import HostExecutor
from dsfunc.zero.offload.staging import ShardStaging


class HostShards:
    """Shards staged on the host from the host masters; the device shards of lazy units kept between gathers."""

    derived = True  # a lazy unit's device shard is made when the copies are refreshed

    def __init__(self, staging: ShardStaging, executor: HostExecutor) -> None:
        self.staging = staging
        self.executor = executor
        device = staging.compute_device
        # offload_param on a GPU: the stream that gathers copy host shards in on, beside the compute stream
        self.stream = torch.cuda.Stream(device) if staging.stream_params and device.type == "cuda" else None
        self.kept: dict[str, torch.Tensor] = {}  # lazy unit -> its compute-dtype shard on the device

    @property
    def writing(self) -> bool:
        """Whether the host update still writes the masters in the background."""
        return self.executor.in_flight

    def settle(self) -> bool:
        """Wait for the host update in the background (True if one was in flight)."""
        return self.executor.wait()

    def shard(self, unit: Unit, master: torch.Tensor) -> torch.Tensor:
        return self.staging.send(unit, self.staging.stage(unit, master))

    def gather_input(self, unit: Unit, master: torch.Tensor) -> torch.Tensor:
        """The device shard kept since the last update, or (``offload_param``) the host shard, to stream in;
        once the background update has written the unit."""
        self.executor.wait_unit(unit.name)
        if self.staging.stream_params:
            return self.staging.staged(unit, master)
        return self.kept[unit.name]

    def to_device(self, unit: Unit, src: torch.Tensor) -> torch.Tensor:
        """``offload_param``: the host shard streams in (on :attr:`stream`), beside the kernels, not between them."""
        return self.staging.send(unit, src) if self.staging.stream_params else src

    def refresh(self, unit: Unit, master: torch.Tensor, staged: bool = False) -> None:
        """Stage a lazy unit's host master (unless ``staged`` already) and, unless its parameters stay on the
        host, copy it into the device shard its gathers send (in place: no second copy of the shards)."""
        staged_shard = self.staging.staged(unit, master) if staged else self.staging.stage(unit, master)
        if not self.staging.stream_params:
            self.kept[unit.name] = self.staging.send(unit, staged_shard, out=self.kept.get(unit.name))

    def device_elements(self, lazy_shards: int) -> int:
        return 0 if self.staging.stream_params else lazy_shards
