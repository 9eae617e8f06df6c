"""DeepSpeed's ``PipelineEngine`` as a shell over a pipelined :class:`~dsfunc.TrainState`.

``engine.train_batch(data_iter)`` pulls ``gradient_accumulation_steps`` ``(inputs, labels)`` micro-batches
on the first and last stages (the others read nothing, as in DeepSpeed) and runs :func:`dsfunc.train_step`,
the pipelined step of :mod:`dsfunc.pipeline.pipelined`; it returns the step's mean loss, the same on every
rank. ``eval_batch`` runs the schedule's forwards only. ``engine(x)``, ``engine.backward`` and
``engine.step`` are refused, as in DeepSpeed: the schedule runs the micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from dsfunc.deepspeed.engine import Engine
from dsfunc.deepspeed.utils import RepeatingLoader
from dsfunc.distributed import comm
from dsfunc.errors import NotSupportedError, UsageError
from dsfunc.step import train_step


class PipelineEngine(Engine):
    """The engine ``deepspeed.initialize`` returns for a ``PipelineModule``."""

    pipeline_parallelism = True

    def __init__(self, state: Any, **kwargs: Any) -> None:
        super().__init__(state, **kwargs)
        pipeline = state.program.run.pipeline
        self.topology = pipeline.topology
        self.global_rank, self.world_size = comm.rank(), comm.world_size()
        self.num_stages, self.stage_id = self.topology.stages, self.topology.stage
        self.micro_batches = self.gradient_accumulation_steps()
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Any = None
        if self.training_dataloader is not None:
            self.set_dataloader(self.training_dataloader)

    def is_first_stage(self) -> bool:
        return self.topology.is_first_stage

    def is_last_stage(self) -> bool:
        return self.topology.is_last_stage

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch`` reads (on the first and last stages; the others read none)."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(RepeatingLoader(loader))

    def set_batch_fn(self, fn: Any) -> None:
        """Post-process each micro-batch read from the iterator."""
        self.batch_fn = fn

    def _micro_batches(self, data_iter: Iterator[Any] | None) -> list[Any]:
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if not (self.is_first_stage() or self.is_last_stage()):
            return [(None, None)] * self.micro_batches
        if self.data_iterator is None:
            raise UsageError("train_batch() needs data: pass data_iter= or give initialize training_data=")
        batches = []
        for _ in range(self.micro_batches):
            batch = next(self.data_iterator)
            batches.append(self.batch_fn(batch) if self.batch_fn is not None else batch)
        return batches

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; the step's mean loss."""
        if not torch.is_grad_enabled():
            raise UsageError("train_batch() needs autograd enabled; use eval_batch() under torch.no_grad()")
        batches = self._micro_batches(data_iter)
        self.module.train()
        self.steps.state = new = train_step(self.state, batches)
        self.global_samples += self.train_batch_size()
        self.monitor.log(new, samples=self.global_samples)
        return new.metrics.loss

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> torch.Tensor:
        """The mean loss over ``gradient_accumulation_steps`` micro-batches of ``data_iter``, on every rank."""
        if return_logits or not compute_loss or reduce_output != "avg" or num_micro_batches not in (None,
                                                                                                    self.micro_batches):
            raise NotSupportedError("eval_batch supports the mean loss only (return_logits=False, compute_loss=True, "
                                    "reduce_output='avg', num_micro_batches = gradient_accumulation_steps)")
        batches = self._micro_batches(data_iter)
        self.module.eval()
        pipeline = self.state.program.run.pipeline
        loss = pipeline.evaluate(self.state, batches)
        self.module.train()
        return loss

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        raise UsageError("Only train_batch() and eval_batch() are accessible in pipeline mode")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError("Only train_batch() and eval_batch() are accessible in pipeline mode")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError("Only train_batch() and eval_batch() are accessible in pipeline mode")

