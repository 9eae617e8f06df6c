"""Who runs the update with the optimizer offloaded: ZeRO-Offload's :class:`~dsfunc.zero.policy.UpdateRunner`.

The update runs where the masters are, on the host (:mod:`dsfunc.optim.host_adam` for the config's Adam/AdamW).
It reads the host gradients (:meth:`HostGrads.collect`), and as each unit's new master is final its new shard is
staged and sent back to the device (:meth:`StepExecutor.unit_done`). At stage 3 the lazy units' share is left to
the :class:`~dsfunc.zero.offload.executor.HostExecutor`, started once the step has refreshed the rest
(:meth:`HostRunner.launch`): the next forward waits for each unit as it gathers it. With ``speculative_update``
each unit's update has started as its gradient landed, and stands where the step's scalars are the ones it
assumed (:mod:`dsfunc.zero.offload.speculation`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from dsfunc import kernels
from dsfunc.optim.update import UnitWork, UpdateContext
from dsfunc.zero.offload.grads import HostGradMap
from dsfunc.zero.offload.host import HostOffload

if TYPE_CHECKING:
    from dsfunc.zero.gather import Workspace
    from dsfunc.zero.policy import StepScalars


class HostRunner:
    """The host update of each step, unit by unit, the lazy units' in the background."""

    def __init__(self, host: HostOffload, workspace: Workspace) -> None:
        self.host = host
        self.grads = host.grads
        self.shards = host.shards
        self.workspace = workspace
        self.speculation = host.speculation  # each unit's update ahead of the step (None: off)
        self._step: StepExecutor | None = None

    def expect(self, state: Any, update: Any) -> None:
        """With ``speculative_update``, run ``update``'s own code with the scalars of a step that neither clips
        nor skips (a zero sum of squares), recording each unit's work to start as its gradient lands
        (:mod:`dsfunc.zero.offload.speculation`). Only an update that runs on the host unit by unit through its
        executor (the fused Adam, the bf16 masters' chain) hands it work; any other runs as without speculation."""
        if self.speculation is None or not (update.writes_compute_copy or getattr(update, "by_unit", False)):
            return
        program = state.program
        scale = state.scaler.scale
        finite, skip, norm, grad_scale, _ = kernels.step_scalars(
            torch.zeros((), device=scale.device), scale, update.clip_norm, program.scaler.unscaled)
        cpu = torch.device("cpu")
        ctx = UpdateContext(loss_scale=scale.to(cpu), grad_norm=norm.to(cpu), grad_scale=grad_scale.to(cpu),
                            finite=finite.to(cpu), skip=skip.to(cpu), lowp={}, segment_norm=program.segment_norm,
                            executor=self.speculation)
        self.speculation.expect(lambda grads: update.apply(state.params, grads, state.opt_state, ctx))

    def collect(self, grads: Mapping[str, torch.Tensor | None]) -> tuple[HostGradMap, torch.Tensor]:
        """The gradients in host memory, and their sum of squares (taken on the device)."""
        return self.grads.collect(grads)

    def context(self, scalars: StepScalars, lowp: Mapping[str, torch.Tensor], grads: HostGradMap,
                segment_norm: Callable | None, lr: Mapping[str | None, float] | None) -> UpdateContext:
        """The step's facts on the host, the compute copies written into host staging buffers (``lowp``, the
        device's, is not the update's to write: its shards come back through :meth:`StepExecutor.unit_done`)."""
        host_lowp = self.shards.staging.staging_map(grads)  # each unit's buffer taken as the update reaches it
        scalars = type(scalars)(*(t.to(torch.device("cpu")) for t in scalars))
        if self.speculation is not None:
            self.speculation.known()
        self._step = StepExecutor(self, host_lowp, grads, skipped=not bool(scalars.finite))
        return UpdateContext(**scalars._asdict(), lowp=host_lowp, segment_norm=segment_norm, executor=self._step,
                             lr=lr)

    def written(self, lowp: Mapping[str, torch.Tensor]) -> set[str]:
        """The units already on their way back to the device (those of the background too)."""
        return self._step.sent

    def launch(self) -> None:
        """The lazy units' host update, beside the next forward."""
        self.shards.executor.start()
        self._step = None

    def host_bytes(self) -> int:
        return self.host.host_bytes()


class StepExecutor:
    """One step's :class:`~dsfunc.optim.update.UnitExecutor`: the eager units now, the lazy ones in the background;
    each unit's new shard sent back as it is done."""

    on_host = True

    def __init__(self, runner: HostRunner, lowp: Mapping[str, torch.Tensor], grads: HostGradMap, *,
                 skipped: bool) -> None:
        self._runner = runner
        self._lowp = lowp
        self._grads = grads
        self._skipped = skipped
        self.sent: set[str] = set()  # units on their way back to the device
        self._background: set[str] = set()

    def run(self, names: list[str], work: UnitWork) -> None:
        workspace = self._runner.workspace
        speculation = self._runner.speculation
        stood: set[str] = set()
        if speculation is not None:  # the units whose update ran ahead of the step and stands are done
            stood = set(speculation.settle(names, work, self._grads))
        is_lazy = {n: workspace.lazy(workspace.plan.unit(n)) for n in names}
        lazy, eager = [n for n in names if is_lazy[n]], [n for n in names if not is_lazy[n]]
        for name in eager:  # only the stood units' shards go back (the lazy ones' beside the next forward, below)
            if name in stood:
                self._finish(name, work.writes(name)[0], staged=False)
        now = [n for n in eager if n not in stood]
        if now:
            work(now)
        # the lazy units in the order the next forward gathers them, each updated or (it stood) only sent
        sent = functools.partial(self._sent, work)
        for ahead, run in itertools.groupby(lazy, key=stood.__contains__):
            self._later(list(run), sent if ahead else work)

    def _later(self, names: list[str], work: Callable[[list[str]], None]) -> None:
        """``work(names)`` on the host update's worker, beside the next forward, which waits for each unit."""
        if names:
            self._background.update(names)
            self.sent.update(names)  # their copies go out as the worker writes them
            self._runner.shards.executor.add(names, work)

    def _sent(self, work: UnitWork, names: list[str]) -> None:
        """Send the new shards of ``names``, whose update ``work`` already wrote (it ran ahead and stood)."""
        for name in names:
            self._finish(name, work.writes(name)[0], staged=False)

    def unit_done(self, name: str, master: torch.Tensor) -> None:
        # a skipped update writes nothing, its staging buffer included: the unchanged master is cast into it
        self._finish(name, master, staged=name in self._lowp and not self._skipped)

    def _finish(self, name: str, master: torch.Tensor, staged: bool) -> None:
        """Unit ``name``'s new ``master`` is final: its shard goes back (from the staging buffer the update
        wrote, if ``staged``), its gradient buffers are free."""
        if self._send(name, master, staged=staged):
            self.sent.add(name)
        runner = self._runner
        # after the send: the update may have written the shard over the gradient
        runner.grads.device_sums.done(name, after=runner.shards.staging.after_send(name))
        if name in self._background:
            runner.shards.executor.unit_done(name)

    def _send(self, name: str, master: torch.Tensor, staged: bool) -> bool:
        """Stage unit ``name``'s new host master (unless the update already wrote its staging buffer: ``staged``)
        and start its copy into its place on the device, so the copy overlaps the next unit's update. True when
        it did: the workspace's refresh then counts the unit as written."""
        workspace, shards = self._runner.workspace, self._runner.shards
        unit = workspace.plan.unit(name)
        if workspace.lazy(unit):
            shards.refresh(unit, master, staged)
            return True
        own = workspace.own_slice(unit)
        if own is None:  # no copy built yet: refresh builds it
            return False
        staging = shards.staging
        staging.send(unit, staging.staged(unit, master) if staged else staging.stage(unit, master), out=own)
        return True
