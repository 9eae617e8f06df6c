"""Reduced gradients are kept in the narrowest dtype that holds them exactly, on the device as on the host."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from dsfunc.grad import GradContext, GradResult
from dsfunc.zero import memory_estimate
from dsfunc.zero.runtime import local_runtime, zero_runtime
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

PRECISIONS = {"bf16": (torch.bfloat16, {"bf16": {"enabled": True}}),
              "fp16": (torch.float16, {"fp16": {"enabled": True, "initial_scale_power": 8}})}


def make_state(stage: int, precision: str, *, micro: int = 4, gas: int = 1, world: int = 1, **extra):
    torch.manual_seed(0)
    cfg = config(micro=micro, gas=gas, world=world, stage=stage, gradient_clipping=1.0,
                 **PRECISIONS[precision][1], **extra)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return dsfunc.init_state(MLP(width=10, depth=3), cfg)


def step_grads(state) -> dict[str, torch.Tensor]:
    return dsfunc.default_grad_fn()(GradContext(state), mlp_batches(1, 4)[0]).grads


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_micro_batch_on_one_rank_keeps_the_backward_dtype_and_sums_widen(stage, precision):
    dtype = PRECISIONS[precision][0]
    one = make_state(stage, precision)
    assert {g.dtype for g in step_grads(one).values()} == {dtype}
    two = make_state(stage, precision, micro=2, gas=2)
    assert {g.dtype for g in step_grads(two).values()} == {torch.float32}
    psi = sum(u.numel for u in one.program.plan.units)
    assert memory_estimate(one)["gradients"] == 2 * psi and memory_estimate(two)["gradients"] == 4 * psi


@pytest.mark.parametrize("stage", [0, 3])
def test_a_transform_chain_gets_fp32_gradients_on_the_device(stage):
    """Lamb runs as its transform chain, which reads whole fp32 trees: 16-bit device gradients would be widened
    all at once beside themselves, so they are fp32 from the start (the estimate says so too)."""
    state = make_state(stage, "bf16", optimizer={"type": "Lamb", "params": {"lr": 1e-2}})
    assert {g.dtype for g in step_grads(state).values()} == {torch.float32}
    assert memory_estimate(state)["gradients"] == 4 * sum(u.numel for u in state.program.plan.units)


def _widening(ctx: GradContext, batch) -> GradResult:
    result = dsfunc.default_grad_fn()(ctx, batch)
    return GradResult(result.loss, {name: g.float() for name, g in result.grads.items()})


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 3])
def test_16_bit_gradients_train_bit_for_bit_like_their_fp32_widening(stage, precision):
    """Clipping 1.0 and (fp16) the loss scale act on them: the norm and the fused update widen them exactly."""
    opt = {"type": "AdamW", "params": {"lr": 1e-2}}
    widened_step = dsfunc.make_train_step(grad_fn=_widening)
    kept, widened = make_state(stage, precision, optimizer=opt), make_state(stage, precision, optimizer=opt)
    for batch in mlp_batches(6, 4):
        kept, widened = dsfunc.train_step(kept, batch), widened_step(widened, batch)
        assert torch.equal(kept.metrics.grad_norm, widened.metrics.grad_norm)
    for name, want in dsfunc.full_params(widened).items():
        assert torch.equal(dsfunc.full_params(kept)[name], want), name


@pytest.mark.parametrize("make_runtime", [local_runtime, zero_runtime])
def test_another_backward_of_the_micro_batch_adds_in_fp32(make_runtime):
    state = make_state(0, "bf16")
    batch = mlp_batches(1, 4)[0]
    sums = {}
    for backwards in (1, 2):
        runtime = make_runtime(state)
        loss = runtime.forward(lambda model, b: model(*b), batch)
        for i in range(backwards):
            runtime.backward(loss * (1 + i), retain_graph=i + 1 < backwards)
        runtime.end()
        sums[backwards] = runtime.finish()[1]
    for name, once in sums[1].items():
        assert once.dtype == torch.bfloat16 and sums[2][name].dtype == torch.float32
        assert torch.equal(sums[2][name], once.float() + (2 * once).float())  # x2 is exact in bf16


def reduced_dtypes(rank: int, world: int) -> dict[str, set[torch.dtype]]:
    out = {}
    for comm in ("fp32", "bf16"):
        for stage in (0, 2):
            state = make_state(stage, "bf16", micro=2, world=world, communication_data_type=comm)
            runtime = zero_runtime(state)
            x, y = mlp_batches(1, 2 * world)[0]
            mine = (x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
            loss = runtime.forward(lambda model, b: model(*b), mine)
            runtime.backward(loss)
            runtime.end()
            out[f"{comm}/{stage}"] = {g.dtype for g in runtime.finish()[1].values()}
    return out


def test_over_two_ranks_the_collective_decides():
    """A sum of two bf16 gradients needs fp32, unless the collective itself sums in bf16."""
    for got in run_world(reduced_dtypes, 2):
        assert got == {"fp32/0": {torch.float32}, "fp32/2": {torch.float32},
                       "bf16/0": {torch.bfloat16}, "bf16/2": {torch.bfloat16}}


def reduce_scatters_of_a_step(rank: int, world: int, stage: int) -> tuple[int, int]:
    """The reduce-scatters one step of two micro-batches issues (c10d's ops, as torch's profiler records them), and
    the number of units; the step before warms everything up."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(width=10, depth=3), config(micro=2, gas=2, world=world, stage=stage))
    first, second = mlp_batches(2, 4, seed=rank)
    state = dsfunc.train_step(state, first)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        state = dsfunc.train_step(state, second)
    count = sum(1 for e in prof.events() if e.name.startswith("c10d::") and "reduce_scatter" in e.name)
    return count, len(state.program.plan.units)


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_reduce_scatters_once_a_step_and_stage_2_once_a_micro_batch(stage):
    """Stage 1 sums the micro-batches locally and reduce-scatters each unit once, after the last (the reason it
    exists beside stage 2, which frees each micro-batch's full gradient by reducing it at once)."""
    for count, units in run_world(reduce_scatters_of_a_step, 2, stage):
        assert units > 1 and count == units * (1 if stage == 1 else 2), (count, units)
