"""The pipelined step: one rank's stage run by a ``torch.distributed.pipelining`` schedule inside the one
micro-batch runtime.

A pipelined state is an ordinary state over this rank's stage module, its ZeRO over the stage's
data-parallel ranks (its plan's group, :meth:`Topology.data`). Its step is the
ordinary one (:func:`dsfunc.step.make_train_step`) with :meth:`Pipeline.grad_fn` as the gradient function:

* the runtime binds the stage's parameters once for the whole step (:meth:`MicroBatchRuntime.run_backwards`)
  and the schedule runs every micro-batch's forward and backward through them; the last stage's loss is
  multiplied by the runtime's seed (loss scale / replicas / micro-batches), so the gradients reaching the
  reducer are the mean over the global batch, as :func:`dsfunc.shard` makes them;
* a tied module's gradients (reduced over the replicas) are then summed over the stages holding it, so its
  copies take the same update and stay equal;
* the update half (:func:`dsfunc.apply_gradients`) takes its global norm from :meth:`Pipeline.norm_and_loss`:
  every stage's sum of squares (a tied module's once) and the last stage's loss, summed over the pipeline
  group, so clipping, the overflow check and the metrics are the whole model's on every rank.

With tensor parallelism the stage module's layers were split over the stage's tp ranks as an unpipelined model's
are (:mod:`dsfunc.parallel.tensor`): a split block's output is all-reduced back to a full tensor, so the activations
and their gradients a stage sends are full, tp-replicated tensors, tp rank ``t`` of one stage talking to tp rank
``t`` of the next over its own pipeline group; each stage's norm already sums its split parameters' parts over tp.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.distributed as dist

from dsfunc.batch import Batch, scalar_loss, split_batch
from dsfunc.distributed import comm
from dsfunc.errors import InputError
from dsfunc.grad import GradContext, GradFn, GradResult, scale_loss
from dsfunc.pipeline.schedules import make_schedule
from dsfunc.pipeline.stage import TIED_PREFIX
from dsfunc.pipeline.topology import Topology
from dsfunc.step import make_train_step
from dsfunc.zero.layout import ShardingPlan
from dsfunc.zero.norms import global_norm_and_loss
from dsfunc.zero.runtime import zero_runtime

if TYPE_CHECKING:
    from dsfunc.program import Program
    from dsfunc.state import TrainState


class Pipeline:
    """The static pipeline half of a program (``program.run.pipeline``): the grid, the schedule, the loss."""

    def __init__(self, topology: Topology, schedule: str, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.topology = topology
        self.schedule_name = schedule
        self.loss_fn = loss_fn
        self._schedule: Any = None
        self._schedule_for: tuple[int, int] | None = None  # (id of the stage module, micro-batches)
        self._seed: torch.Tensor | float = 1.0
        self._losses: list[torch.Tensor] = []
        # a tied module's gradient counts in the norm on the first stage holding it only
        self.uncounted = {f"{TIED_PREFIX}.{key}" for key, holders in topology.tied_holders.items()
                          if min(holders) != topology.stage}

    # -- the step ------------------------------------------------------------------------------------
    def step_fn(self) -> Callable[..., TrainState]:
        """``train_step`` of a pipelined state: the ordinary step over :meth:`grad_fn`."""
        return make_train_step(self.grad_fn())

    def grad_fn(self) -> GradFn:
        """``scale_loss(pipelined)``: the step's gradients of this stage, reduced over its replicas."""
        return scale_loss()(self._pipelined)

    def _pipelined(self, ctx: GradContext, batch: Batch) -> GradResult:
        state = ctx.state
        program = state.program
        n = program.config.gradient_accumulation_steps
        inputs, labels = self.split(batch, n, program.config.train_micro_batch_size_per_gpu, program.device)
        runtime = zero_runtime(state)
        self._seed = runtime.seed(ctx.cotangent, n)
        schedule = self.schedule(program, n)
        self._losses = []
        topo = self.topology

        def run() -> torch.Tensor:
            args = (inputs if isinstance(inputs, tuple) else (inputs,)) if topo.is_first_stage else ()
            schedule.step(*args, target=labels if topo.is_last_stage else None)
            if topo.is_last_stage:
                return torch.stack(self._losses[-n:]).mean()  # (shape inference computes a loss of its own first)
            return torch.zeros((), device=program.device)

        runtime.run_backwards(run)
        runtime.end()
        loss, grads = runtime.finish()
        for key, group in topo.tied_groups.items():
            name = f"{TIED_PREFIX}.{key}"
            if group is not None and grads.get(name) is not None:
                summed = grads[name].float()
                comm.all_reduce_sum(summed, group)
                grads[name] = summed
        return GradResult(loss, grads)

    def _stage_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = scalar_loss(self.loss_fn(output, target))
        self._losses.append(loss.detach().float())
        return loss.float() * self._seed

    def schedule(self, program: Program, micro_batches: int) -> Any:
        """The schedule over the program's stage module (made on first use; torch infers the shapes then)."""
        key = (id(program.skeleton), micro_batches)
        if self._schedule_for != key:
            self._schedule = make_schedule(self.schedule_name, program.skeleton, self.topology, program.device,
                                           micro_batches, self._stage_loss)
            self._schedule_for = key
        return self._schedule

    def split(self, batch: Batch, n: int, micro: int, device: torch.device) -> tuple[Any, Any]:
        """``(inputs, labels)`` of the whole step on the device, from ``(inputs, labels)`` or a list of ``n``
        such pairs; a stage that does not read a part may get None for it."""
        if isinstance(batch, list) and len(batch) == n and all(isinstance(b, (tuple, list)) and len(b) == 2
                                                               for b in batch):
            parts = [[b[i] for b in batch] for i in (0, 1)]
            joined = [None if any(p is None for p in part) else
                      optree.tree_map(lambda *t: torch.cat(t), *part) for part in parts]
            inputs, labels = joined
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs, labels = batch
        else:
            raise InputError(
                "a pipelined step takes (inputs, labels) for the whole step (micro_batch x "
                f"gradient_accumulation_steps samples along dim 0) or a list of {n} (inputs, labels) micro-batches; "
                "inputs go to the first stage's first layer, labels to loss_fn(outputs, labels) on the last"
            )
        topo = self.topology
        for part, needed, what in ((inputs, topo.is_first_stage, "inputs"), (labels, topo.is_last_stage, "labels")):
            if needed and part is None:
                raise InputError(f"pipeline stage {topo.stage} needs the batch's {what}, got None")
            if needed:
                split_batch(part, n, micro)  # names a batch that is not micro_batch x accumulation steps
        move = (lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
        inputs = tuple(move(t) for t in inputs) if isinstance(inputs, (tuple, list)) else move(inputs)
        return inputs, optree.tree_map(move, labels) if labels is not None else None

    # -- the update half -----------------------------------------------------------------------------
    def norm_and_loss(self, plan: ShardingPlan, grads: Mapping[str, torch.Tensor],
                      loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole model's sum of squares (each tied module once, a tp-split parameter's parts summed over tp) and
        the last stage's mean loss."""
        counted = {name: g for name, g in grads.items() if name not in self.uncounted}
        sumsq, loss = global_norm_and_loss(plan, counted, loss)
        if self.topology.stages == 1:
            return sumsq, loss
        packed = torch.stack([sumsq.float(), loss.float() if self.topology.is_last_stage else torch.zeros_like(
            loss, dtype=torch.float32)])
        comm.all_reduce_sum(packed, self.topology.pipe)
        return packed[0], packed[1]

    def gather_stages(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's ``tensors`` merged (on every rank), in stage order: the whole model's."""
        if self.topology.stages == 1:
            return tensors
        parts: list[Any] = [None] * self.topology.stages
        dist.all_gather_object(parts, {k: v.cpu() for k, v in tensors.items()}, group=self.topology.pipe_group)
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                out.setdefault(k, v)
        return out

    def whole_model(self, meta: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint description of this stage joined with every other stage's (on every rank): units, state
        dict entries, buffers and tensors, each once (a tied module is in several stages), units and entries in
        the one-stage module's order (tied modules, then layers by index)."""
        if self.topology.stages == 1:
            return meta
        parts: list[Any] = [None] * self.topology.stages
        dist.all_gather_object(parts, meta, group=self.topology.pipe_group)
        whole = dict(parts[0])
        for field, first_of in (("units", lambda u: u["name"]), ("state_dict", lambda e: e[0])):
            seen: dict[str, Any] = {}
            for part in parts:
                for item in part[field]:
                    seen.setdefault(first_of(item), item)
            whole[field] = sorted(seen.values(), key=lambda item, f=first_of: _layer_order(f(item)))
        for field in ("buffers", "tensors"):
            whole[field] = {k: v for part in parts for k, v in part[field].items()}
        whole["pipeline_stages"] = self.topology.stages
        return whole

    def evaluate(self, state: TrainState, batch: Batch) -> torch.Tensor:
        """The mean loss of ``batch`` over the micro-batches and replicas, on every rank (no gradients)."""
        program = state.program
        n = program.config.gradient_accumulation_steps
        inputs, labels = self.split(batch, n, program.config.train_micro_batch_size_per_gpu, program.device)
        runtime = zero_runtime(state)
        schedule = self.schedule(program, n)
        self._losses, self._seed = [], 1.0
        topo = self.topology
        with torch.no_grad():
            runtime.begin_evaluation()
            try:
                args = (inputs if isinstance(inputs, tuple) else (inputs,)) if topo.is_first_stage else ()
                schedule.eval(*args, target=labels if topo.is_last_stage else None)
            finally:
                runtime.end_evaluation()
        loss = torch.stack(self._losses[-n:]).mean() if topo.is_last_stage else torch.zeros((), device=program.device)
        return self.norm_and_loss(program.plan, {}, loss)[1]


def _layer_order(name: str) -> tuple[int, int]:
    """Where a unit or state-dict key of a :class:`~dsfunc.pipeline.StageModule` sits in the one-stage module:
    tied modules first, then layers by their index."""
    head = name.split(".", 1)[0]
    return (0, 0) if head == TIED_PREFIX else (1, int(head) if head.isdigit() else -1)
