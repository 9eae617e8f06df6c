"""A loader's batches split along the sequence over the sp ranks, the way DeepSpeed's ALST feeds Ulysses
(``UlyssesSPDataLoaderAdapter``): every sp rank draws a batch of its own, the ranks exchange them, and each
yields its :func:`~dsfunc.parallel.sequence.split_sequence` of every one in rank order. So a draw gives ``sp``
micro-batches, and the sp ranks together train on as many samples as data parallelism over them would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import optree
import torch
import torch.distributed as dist

from dsfunc.distributed.comm import Group
from dsfunc.parallel.sequence import split_sequence


class SequenceShards:
    """Iterate over this rank's shards of the sp group's batches (see the module); an epoch of ``loader`` gives
    ``len(loader) * sp`` of them, and the next ``iter`` starts the next epoch."""

    def __init__(self, loader: Iterable[Any], group: Group, device: torch.device | str | None = None) -> None:
        self.loader = loader
        self.group = group
        self.device = torch.device(device) if device is not None else None
        self._source: Iterator[Any] = iter(loader)
        self._ready: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.loader) * self.group.size  # type: ignore[arg-type]

    def __iter__(self) -> SequenceShards:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self._ready:
            self._draw()
        return self._ready.popleft()

    def _draw(self) -> None:
        try:
            batch = next(self._source)
        except StopIteration:
            self._source = iter(self.loader)  # the next epoch, as DeepSpeed's adapter
            raise
        host = optree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, dict(batch))
        batches = [host]
        if self.group.size > 1:  # sequence lengths may differ between the ranks' batches: sent as objects
            batches = [None] * self.group.size
            dist.all_gather_object(batches, host, group=self.group.process_group)
        for one in batches:
            shard = split_sequence(one, self.group.rank, self.group.size)
            if self.device is not None:
                shard = optree.tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, shard)
            self._ready.append(shard)
