"""Training data: each rank's micro-batches from a map-style dataset, resumable at any step.

:class:`DistributedLoader` is what ``dsfunc.initialize(training_data=...)`` returns (DeepSpeed's engine
dataloader): ``train_micro_batch_size_per_gpu`` samples per batch, a distributed sampler (shuffled, seed
0, as DeepSpeed's) whose epoch **advances** every pass over the data (DeepSpeed never calls
``set_epoch``, so its order repeats each epoch), ``collate_fn`` and ``dataloader_drop_last`` from the
config. ``loader.skip_to(n)`` positions it after the first ``n`` micro-batches of the run, so a resumed
run sees exactly the batches the uninterrupted run would have seen (the engine's ``load_checkpoint``
does this for you).

:func:`batches` is the same stream for the functional API, grouped into whole per-step batches::

    for batch in dsfunc.data.batches(dataset, state):   # resumes at state.step by itself
        state = dsfunc.train_step(state, batch)

Order of samples: in epoch ``e`` the dataset indices are permuted with seed ``seed + e``; rank ``r`` of
``W`` takes positions ``r, r + W, r + 2W, ...`` (the permutation padded to a multiple of ``W`` by
repeating its head, as ``torch.utils.data.DistributedSampler`` does). So a step's global batch is a
contiguous run of the permutation, whatever the world size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from dsfunc.distributed import comm
from dsfunc.errors import InputError, InputTypeError


class DistributedLoader:
    """This rank's micro-batches of a map-style dataset, epoch after epoch, resumable.

    Iterating yields the rest of the current epoch; the next ``iter()`` starts the next epoch (with a new
    shuffle). ``len(loader)`` is the number of micro-batches per epoch on this rank.

    Args:
      dataset: a map-style ``torch.utils.data.Dataset`` (``__getitem__`` and ``__len__``).
      batch_size: samples per micro-batch on this rank.
      rank, world_size: this rank and the number of data-parallel ranks (default: the process group's).
      shuffle: permute the indices every epoch (seed ``seed + epoch``); False keeps dataset order.
      seed: the shuffle seed (DeepSpeed's sampler uses 0).
      drop_last: drop the last micro-batch of an epoch when it is incomplete.
      collate_fn: builds a batch from a list of samples (default: torch's ``default_collate``).
      num_workers, pin_memory: passed to the ``torch.utils.data.DataLoader`` that does the loading.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        check_dataset(dataset)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank = comm.rank() if rank is None else rank
        self.world_size = comm.world_size() if world_size is None else world_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.sampler = DistributedSampler(
            dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle, seed=seed
        )
        self.epoch = 0
        self.offset = 0  # micro-batches of this epoch already yielded

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def position(self) -> int:
        """Micro-batches yielded since the start of the run (epochs included)."""
        return self.epoch * len(self) + self.offset

    def skip_to(self, position: int) -> None:
        """Continue after the first ``position`` micro-batches of the run (any epoch).

        After resuming at optimizer step ``k`` with ``g`` accumulation steps, ``skip_to(k * g)``.
        """
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise InputError(f"skip_to needs a number of micro-batches >= 0, got {position!r}")
        if len(self) == 0:
            raise InputError(
                f"the dataset gives this rank no complete micro-batch ({len(self.sampler)} samples per rank, "
                f"batch size {self.batch_size}, drop_last={self.drop_last})"
            )
        self.epoch, self.offset = divmod(position, len(self))

    def __iter__(self) -> Iterator[Any]:
        if self.offset >= len(self):
            self.epoch, self.offset = self.epoch + 1, 0
        self.sampler.set_epoch(self.epoch)
        indices = list(self.sampler)[self.offset * self.batch_size :]
        loader = DataLoader(
            self.dataset, batch_size=self.batch_size, sampler=indices, collate_fn=self.collate_fn,
            drop_last=self.drop_last, num_workers=self.num_workers, pin_memory=self.pin_memory,
        )
        for batch in loader:
            self.offset += 1
            yield batch
        self.epoch, self.offset = self.epoch + 1, 0

    def stream(self) -> Iterator[Any]:
        """Micro-batches forever, epoch after epoch, from the current position."""
        if len(self) == 0:
            raise InputError(
                f"the dataset gives this rank no complete micro-batch ({len(self.sampler)} samples per rank, "
                f"batch size {self.batch_size}, drop_last={self.drop_last})"
            )
        while True:
            yield from self


def check_dataset(dataset: Any) -> None:
    """Raise ``TypeError`` unless ``dataset`` is a map-style torch Dataset (DeepSpeed's words, which it raises as
    a ValueError, for non-datasets)."""
    if not isinstance(dataset, Dataset):
        raise InputTypeError(
            f"Training data must be a torch Dataset (torch.utils.data.Dataset), got {type(dataset).__name__}; "
            "wrap tensors in torch.utils.data.TensorDataset"
        )
    if isinstance(dataset, IterableDataset):
        raise InputTypeError(
            "training_data is an IterableDataset: dsfunc's loader needs a map-style dataset (__getitem__ and "
            "__len__) to shard it across ranks and resume at a step. Iterate it yourself and pass each rank's "
            "micro-batches to the engine (or per-step batches to dsfunc.train_step)."
        )


def batches(
    dataset: Dataset,
    state: Any,
    *,
    steps: int | None = None,
    start_step: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
) -> Iterator[Any]:
    """This rank's per-step batches for :func:`dsfunc.train_step`, the stream the engine's loader gives.

    Each item holds ``train_micro_batch_size_per_gpu * gradient_accumulation_steps`` samples along dim
    0: the step's micro-batches, collated one by one exactly as the engine loader collates them and
    concatenated (so ``train_step`` splits them back into the same micro-batches). An incomplete last
    micro-batch of an epoch is dropped (``train_step`` needs full ones); with ``dataloader_drop_last:
    true`` the engine sees the same stream.

    Args:
      dataset: a map-style ``torch.utils.data.Dataset``.
      state: the :class:`~dsfunc.TrainState` (its config gives the batch sizes, its plan the rank).
      steps: how many batches to yield (default: forever, epoch after epoch).
      start_step: the optimizer step to start at (default: ``state.step``, so after
        ``dsfunc.load_checkpoint`` the stream resumes where the saved run was).
      shuffle, seed, collate_fn, num_workers: as :class:`DistributedLoader`.
    """
    program = state.program
    config = program.config
    gas = config.gradient_accumulation_steps
    loader = DistributedLoader(
        dataset, config.train_micro_batch_size_per_gpu, rank=program.plan.rank,
        world_size=program.plan.world_size, shuffle=shuffle, seed=seed, drop_last=True,
        collate_fn=collate_fn, num_workers=num_workers,
    )
    loader.skip_to(gas * (int(state.step) if start_step is None else start_step))
    stream = loader.stream()
    for _ in range(steps) if steps is not None else itertools.count():
        micros = [next(stream) for _ in range(gas)]
        yield micros[0] if gas == 1 else _concatenate(micros)


def _concatenate(micros: list[Any]) -> Any:
    def cat(*parts: Any) -> Any:
        if not all(isinstance(p, torch.Tensor) for p in parts):
            raise InputTypeError(
                "dsfunc.data.batches concatenates micro-batches along dim 0, but the collated batch holds a "
                f"{type(parts[0]).__name__}; make collate_fn return tensors only"
            )
        return torch.cat(parts)

    return optree.tree_map(cat, micros[0], *micros[1:])
