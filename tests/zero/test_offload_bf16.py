"""bf16 master weights (and moments) with the optimizer offloaded: the host keeps them in bf16 and runs the update
chain the device runs (:mod:`dsfunc.optim.low_precision`), so every rounding lands bit for bit where the
on-device run's does, and where DeepSpeed's CPU Adam is exact (fp32 arithmetic, one round to nearest) on the
hand-computed reference of ``tests/optim/test_low_precision.py``. On the CPU the offload path runs with separate
host buffers and copies (``tests/zero/test_offload.py``)."""

from __future__ import annotations

import os

import pytest
import torch

import dsfunc
from dsfunc.monitor.progress import startup_summary
from dsfunc.zero import memory_estimate
from tests.models import MLP, mlp_batches
from tests.multiprocess import run_world
from tests.optim.test_low_precision import MICRO, bf16_config, reference, summed, train_ranks

STAGES = [1, 2, 3]


def device_and_host(rank: int, world: int, optimizer: str, rounding: str, states: bool, gas: int,
                    offload: bool | str) -> dict:
    """Each stage trained with the update on the host, and (bf16 moments only) on the device."""
    stages = [3] if offload == "param" else STAGES
    out = {"host": train_ranks(rank, world, optimizer, stages, rounding, states=states, offload=offload, gas=gas)}
    if states:  # bf16 masters keep fp32 moments only under offload (DeepSpeed's rule)
        out["device"] = train_ranks(rank, world, optimizer, stages, rounding, states=states, gas=gas)
    return out


@pytest.mark.parametrize(
    ("optimizer", "rounding", "states", "gas", "offload"),
    [("AdamW", "nearest", True, 1, True), ("AdamW", "nearest", False, 1, True), ("SGD", "kahan", True, 1, True),
     ("AdamW", "stochastic", True, 1, True), ("SGD", "nearest", True, 4, True), ("AdamW", "kahan", True, 1, "param")],
)
def test_the_host_update_lands_where_the_device_and_the_reference_do(optimizer, rounding, states, gas, offload):
    """ZeRO 1-3 on 2 ranks (on one with ``gas`` micro-batches, their gradients summed in bf16 in host memory; at
    stage 3 with the parameters offloaded too, streamed from the bf16 masters), clipping active: the host's bf16
    masters equal the device run's bit for bit, and the reference's where it is deterministic (every rounding but
    stochastic's, whose bits are dsfunc's own)."""
    world = 2 if gas == 1 else 1
    expected, norms = reference(world, optimizer, rounding, states, gas)
    assert min(norms) > 0.5  # the clip acts
    args = (optimizer, rounding, states, gas, offload)
    for rank, result in enumerate(run_world(device_and_host, world, *args, timeout=600)):
        for stage in result["host"]:
            host = result["host"][stage]
            assert host["offloaded"] and host["on_host"]
            assert set(host["masters"]) == {torch.bfloat16}
            assert set(host["moments"]) == {torch.bfloat16 if states else torch.float32}
            if "device" in result:
                device = result["device"][stage]
                assert not device["offloaded"]
                assert all(torch.equal(host["full"][k], v) for k, v in device["full"].items()), (rank, stage)
            if rounding != "stochastic":
                for name, value in expected.items():
                    assert torch.equal(host["full"][name], value), (rank, stage, name)
            else:
                assert any(not torch.equal(host["full"][k], v) for k, v in expected.items())


def per_parameter(stage: int, offload: bool | str, states: bool, rounding: str) -> tuple[dict[str, float], str]:
    cfg = bf16_config(stage, "AdamW", rounding, states=states, offload=offload)
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 2, 2
    state = dsfunc.init_state(MLP(width=10, depth=3), cfg)
    psi = sum(u.numel for u in state.program.plan.units)
    return {k: v / psi for k, v in memory_estimate(state).items()}, startup_summary(state)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_memory_estimate_counts_bf16_masters_moments_and_compensations(stage):
    """Bytes per parameter (one rank) of AdamW's masters and moments, on the device or on the host: fp32 masters
    4 + 8, bf16 masters 2 + 8 (host only) or 2 + 4, Kahan's compensation 2 more, counted with the masters; with the
    optimizer offloaded the bf16 gradient sums 2 more (DeepSpeed's 8 bytes a parameter: master, gradient, moments)."""
    fp32 = bf16_config(stage, "AdamW", offload=True)
    fp32["bf16"] = {"enabled": True}
    fp32["train_micro_batch_size_per_gpu"], fp32["gradient_accumulation_steps"] = 2, 2
    state = dsfunc.init_state(MLP(width=10, depth=3), fp32)
    base = {k: v / sum(u.numel for u in state.program.plan.units) for k, v in memory_estimate(state).items()}
    assert (base["master"], base["optimizer"]) == (4, 8)
    cases = {  # (offload, bf16 moments, rounding) -> (master, optimizer) bytes per parameter
        (False, True, "nearest"): (2, 4), (False, True, "kahan"): (4, 4),
        (True, True, "nearest"): (2, 4), (True, True, "stochastic"): (2, 4), (True, True, "kahan"): (4, 4),
        (True, False, "nearest"): (2, 8), (True, False, "kahan"): (4, 8),
    }
    for (offload, states, rounding), (master, optimizer) in cases.items():
        est, summary = per_parameter(stage, offload, states, rounding)
        assert (est["master"], est["optimizer"]) == (master, optimizer), (offload, states, rounding)
        states_bytes = master + optimizer
        if offload:  # the states leave the device, with the gradient sums, 2 bytes in bf16 (fp32 masters: 4, and
            # staging buffers; bf16 ones: the update's new shard goes out over the gradient it read)
            assert est["host_buffers"] == 2 < base["host_buffers"] - 2 and est["host"] == states_bytes + 2
            assert est["device"] == base["device"]
            assert f"bf16 master{' + compensation' if rounding == 'kahan' else ''}, optimizer state" in summary
        else:
            assert est["host"] == 0 and est["device"] == est["total"]
            assert "bf16 master" in summary
    if stage == 3:  # the parameters offloaded too: the gathers stream the bf16 masters themselves, no copy of them
        est, summary = per_parameter(stage, "param", True, "nearest")
        assert (est["master"], est["optimizer"], est["host_buffers"], est["host"]) == (2, 4, 2, 8)
        assert "parameters streamed from the host" in summary



def deepspeed_sums(rank: int, world: int, stage: int, gas: int) -> list[torch.Tensor]:
    """DeepSpeed's own bf16 gradient buffer (what its CPU Adam reads) after ``gas`` micro-batches with the optimizer
    offloaded, and the reference's sums of the same micro-batches' gradients, rounded to bf16 after each addition
    (as dsfunc sums them: the tests above) and rounded once at the end."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    torch.manual_seed(0)
    net = MLP(width=10, depth=3)
    ref = MLP(width=10, depth=3)
    ref.load_state_dict(net.state_dict())
    ref = ref.bfloat16()
    config = bf16_config(stage, "AdamW", offload=True, gas=gas)
    config["optimizer"]["params"]["torch_adam"] = False  # bf16 masters under offload take DeepSpeedCPUAdam
    del config["bf16"]["rounding"]  # dsfunc's key (to nearest: DeepSpeed's)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    ((x, y),) = mlp_batches(1, MICRO * gas)
    for k in range(0, MICRO * gas, MICRO):
        if k:
            engine.step()  # DeepSpeed's loop steps after every micro-batch (the boundary's read below, first)
        engine.backward(engine(x[k : k + MICRO].bfloat16(), y[k : k + MICRO]))
    optimizer = engine.optimizer
    flat = optimizer.fp32_partitioned_groups_flat if stage == 3 else optimizer.single_partition_of_fp32_groups
    out = [torch.cat([t.grad.float() for t in flat])]
    for rounded in (True, False):
        sums = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
        summed(ref, x, y, gas, sums, rounded)
        out.append(torch.cat([sums[n].bfloat16().float().flatten() for n, _ in ref.named_parameters()]))
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_sums_micro_batches_in_bf16_too(stage):
    """Real DeepSpeed 0.19.8 on the CPU, ZeRO-Offload with bf16 masters, gradients and moments, 4 micro-batches: its
    gradient buffer is bf16 and holds the sum rounded after each micro-batch, bit for bit, not the fp32 sum."""
    theirs, rounded_each, rounded_once = run_world(deepspeed_sums, 1, stage, 4, timeout=600)[0]
    assert torch.equal(theirs, rounded_each)
    assert not torch.equal(theirs, rounded_once)
