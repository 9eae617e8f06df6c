"""ZeRO-Offload on real gloo processes: the masters and optimizer state in host memory, the update on the
host, and the same parameters as the run without it.

On the CPU the compute device is the host too, but the offload path still runs: its host buffers are
separate tensors, gradients and parameters are copied through them, and the update is torch's fused CPU
Adam. Adam therefore agrees to float32 rounding (the kernels round differently), a chain update bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from dsfunc.zero import memory_estimate
from dsfunc.zero.offload import HostOffload
from dsfunc.zero.offload.staging import ShardStaging
from tests.models import MLP, config, mlp_batches, relative_diff
from tests.multiprocess import run_world

STEPS = 4
OPTIMIZER = {"device": "cpu"}
# offload modes: none, the optimizer (stages 1-3), the optimizer and the parameters (stage 3)
MODES = {"none": {}, "optimizer": {"offload_optimizer": OPTIMIZER},
         "param": {"offload_optimizer": OPTIMIZER, "offload_param": {"device": "cpu"}}}


def host_of(state: dsfunc.TrainState) -> HostOffload | None:
    """The run's host side (None when nothing is offloaded): what its update runner works with."""
    return getattr(state.program.run.runner, "host", None)


def make_state(world: int, stage: int, mode: str, *, micro: int = 2, gas: int = 2, seed: int = 0,
               device_sums: int = 0, **extra: object) -> dsfunc.TrainState:
    """``device_sums``: offload_optimizer.grad_accumulation_on_device (elements)."""
    torch.manual_seed(seed)
    cfg = config(micro=micro, gas=gas, world=world, stage=stage, gradient_clipping=0.05, **extra)
    cfg["zero_optimization"].update(MODES[mode], stage3_param_persistence_threshold=0)
    if device_sums:
        cfg["zero_optimization"]["offload_optimizer"] = {**OPTIMIZER, "grad_accumulation_on_device": device_sums}
    return dsfunc.init_state(MLP(width=10, depth=3), cfg)


def train(state: dsfunc.TrainState, rank: int, world: int, steps: int = STEPS, start: int = 0,
          poison: int | None = None) -> dsfunc.TrainState:
    """``steps`` steps of the global batch; ``poison``: the step whose input holds an inf on rank 0."""
    n = state.program.config.train_micro_batch_size_per_gpu * state.program.config.gradient_accumulation_steps
    for i, (x, y) in enumerate(mlp_batches(start + steps, n * world)[start:], start):
        x, y = x[rank * n : (rank + 1) * n].clone(), y[rank * n : (rank + 1) * n]
        if i == poison and rank == 0:
            x[0, 0] = float("inf")
        state = dsfunc.train_step(state, (x, y))
    return state


def every_mode(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 2, 3):
        for mode in MODES if stage == 3 else ("none", "optimizer"):
            state = train(make_state(world, stage, mode), rank, world)
            host = [t.device.type == "cpu" for t in state.params.values()]
            offload = host_of(state)
            out[stage, mode] = {
                "full": dsfunc.full_params(state), "host": all(host), "offload": offload is not None,
                "separate": offload is None or all(
                    b.data_ptr() != p.data_ptr() for b, p in zip(state.program.run.workspace.buffers.values(),
                                                                 state.params.values())),
                "grad_norm": state.metrics.grad_norm.item(),
            }
    return out


@pytest.mark.parametrize("world", [1, 4])  # 4 ranks shard the host buffers; 2 would add no case
def test_offload_gives_the_parameters_of_the_run_without_it(world):
    """Stages 1-3, two micro-batches per step, clipping on; offload_param at stage 3 too."""
    for rank, results in enumerate(run_world(every_mode, world)):
        for (stage, mode), r in results.items():
            reference = results[stage, "none"]
            assert r["offload"] == (mode != "none") and r["host"] and r["separate"]
            diff = relative_diff(r["full"], reference["full"])
            assert diff < 1e-6, f"world {world} rank {rank} stage {stage} {mode}: {diff}"
            assert abs(r["grad_norm"] - reference["grad_norm"]) <= 1e-6 * reference["grad_norm"]
            assert reference["grad_norm"] > 0.05  # clipping did act


def chain_update(rank: int, world: int) -> dict:
    lamb = {"type": "Lamb", "params": {"lr": 1e-2}}
    return {mode: dsfunc.full_params(train(make_state(world, 2, mode, optimizer=lamb), rank, world))
            for mode in ("none", "optimizer")}


def test_a_chain_update_on_the_host_is_bitwise_the_same():
    """Lamb runs as a transform chain (no fused kernel): the same arithmetic, on the host."""
    for r in run_world(chain_update, 2):
        assert relative_diff(r["optimizer"], r["none"]) == 0.0


def fp16_overflow(rank: int, world: int) -> dict:
    out = {}
    for mode in ("none", "optimizer", "param"):
        state = make_state(world, 3, mode, fp16={"enabled": True, "initial_scale_power": 8},
                           scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3}})
        state = train(state, rank, world, steps=2, poison=1)
        skipped = int(state.metrics.skipped)
        state = train(state, rank, world, steps=2, start=2)
        out[mode] = {"skipped": skipped, "full": dsfunc.full_params(state), "scale": state.scaler.scale.item(),
                     "lr": state.metrics.lr.item(), "lr_device": state.metrics.lr.device.type}
    return out


def test_fp16_overflow_skips_the_host_update_on_every_rank():
    for r in run_world(fp16_overflow, 2):
        reference = r["none"]
        assert reference["skipped"] == 1
        for mode in ("optimizer", "param"):
            assert r[mode]["skipped"] == 1 and r[mode]["scale"] == reference["scale"]
            assert r[mode]["lr"] == reference["lr"]  # the schedule did not advance on the skipped step either
            assert relative_diff(r[mode]["full"], reference["full"]) < 1e-6, mode


def save_offloaded(rank: int, world: int, root: str) -> dict:
    """Offloaded at stage 2: 3 steps, save, 2 more; then a fresh offloaded state resumes from the save."""
    state = train(make_state(world, 2, "optimizer", micro=4, gas=1), rank, world, steps=3)
    ckpt.save_checkpoint(state, Path(root) / "off", tag="s3")
    saved = dsfunc.full_params(state)
    state = train(state, rank, world, steps=2, start=3)
    resumed, _ = ckpt.load_checkpoint(Path(root) / "off", make_state(world, 2, "optimizer", micro=4, gas=1, seed=5))
    resumed = train(resumed, rank, world, steps=2, start=3)
    return {"saved": saved, "uninterrupted": dsfunc.full_params(state), "resumed": dsfunc.full_params(resumed)}


def load_elsewhere(rank: int, world: int, root: str, mode: str, stage: int) -> dict:
    """The offloaded checkpoint at another world size, with or without offload: loaded, then 2 steps."""
    state, _ = ckpt.load_checkpoint(Path(root) / "off", make_state(world, stage, mode, micro=8 // world, gas=1,
                                                                   seed=5))
    loaded = dsfunc.full_params(state)
    return {"loaded": loaded, "after": dsfunc.full_params(train(state, rank, world, steps=2, start=3))}


def test_checkpoints_move_between_offloaded_and_on_device_states_and_world_sizes(tmp_path):
    saved = run_world(save_offloaded, 2, str(tmp_path))
    for r in saved:
        assert relative_diff(r["resumed"], r["uninterrupted"]) == 0.0  # exact resume with offload
    plain = load_elsewhere(0, 1, str(tmp_path), "none", 3)  # in this process: no process group
    moved = run_world(load_elsewhere, 4, str(tmp_path), "param", 3)
    assert relative_diff(plain["loaded"], saved[0]["saved"]) == 0.0
    for r in moved:
        assert relative_diff(r["loaded"], saved[0]["saved"]) == 0.0
        assert relative_diff(r["after"], plain["after"]) < 1e-6
    assert relative_diff(plain["after"], saved[0]["uninterrupted"]) < 1e-6


@pytest.mark.parametrize(
    "zero, expected",
    [
        ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}},
         'offload_optimizer.device = "nvme": offloading optimizer state to NVMe (ZeRO-Infinity) is not built'),
        ({"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 8}, "offload_optimizer": {"device": "cpu"}},
         "offload_param.buffer_count = 8: dsfunc's offload to the CPU has no use for it"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "pipeline_read": True}},
         "offload_optimizer.pipeline_read = true"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": False}},
         'Unknown config key "zero_optimization.offload_optimizer.pin_memroy". Did you mean'),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "grad_accumulation_on_device": -1}},
         "offload_optimizer.grad_accumulation_on_device = -1 is invalid: expected an integer >= 0"),
        ({"stage": 3, "offload_optimizer": {"device": "cpu"},
          "offload_param": {"device": "cpu", "grad_accumulation_on_device": 10}},
         'Unknown config key "zero_optimization.offload_param.grad_accumulation_on_device"'),
    ],
)
def test_offload_config_errors(zero, expected):
    with pytest.raises(dsfunc.ConfigError) as raised:
        dsfunc.init_state(MLP(), {"train_batch_size": 2, "zero_optimization": zero})
    assert expected in str(raised.value)


def test_memory_estimate_splits_host_and_device():
    from dsfunc.monitor.progress import startup_summary

    est = {}
    for stage, mode in ((1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer"), (3, "optimizer"), (3, "param")):
        state = make_state(1, stage, mode, bf16={"enabled": True})
        est[stage, mode] = memory_estimate(state)
    psi = sum(p.numel() for p in state.params.values())
    plan = state.program.plan
    lazy = sum(plan.shard_size(u) for u in plan.units if state.program.run.workspace.lazy(u))
    on_device, off = est[2, "none"], est[2, "optimizer"]
    assert on_device["host"] == 0 and on_device["device"] == on_device["total"]
    # master, moments, host gradient, and the few staging buffers the new bf16 shards pass through to the device
    staging = 2 * min(ShardStaging.staging_buffers, len(plan.units)) * max(plan.shard_size(u) for u in plan.units)
    assert staging < 2 * psi
    assert off["host"] == 4 * psi + 8 * psi + 4 * psi + staging
    # two micro-batches a step: master, moments and the gradient shard leave the device at stage 2, whose
    # micro-batch sums go to the host; stage 1 sums micro-batches on the device before its one reduction
    assert off["device"] == on_device["device"] - (12 + 4) * psi
    assert est[1, "optimizer"]["device"] == est[1, "none"]["device"] - 12 * psi
    assert est[3, "optimizer"]["device"] - est[3, "param"]["device"] == 2 * lazy  # the shards kept on the device
    assert est[3, "param"]["host"] == off["host"] - staging + 2 * psi  # offload_param keeps every unit's bf16 shard
    assert "ZeRO-Offload:" in startup_summary(state) and "parameters streamed from the host" in startup_summary(state)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_engine_trains_offloaded_and_gathered_writes_reach_the_host_masters(stage):
    """At stage 3 the host update runs in the background: the engine's next forward waits per unit, and the
    write through GatheredParameters waits for all of it first."""
    import dsfunc as deepspeed

    full = {}
    for mode in ("none", "optimizer"):
        torch.manual_seed(0)
        net = MLP(width=10, depth=3)
        cfg = config(micro=2, gas=2, stage=stage)
        cfg["zero_optimization"].update(MODES[mode])
        engine, _, _, _ = deepspeed.initialize(model=net, config=cfg)
        for x, y in mlp_batches(3, 4):
            for i in (0, 2):
                engine.backward(engine(x[i : i + 2], y[i : i + 2]))
                engine.step()
        with deepspeed.zero.GatheredParameters([net.inp.weight], modifier_rank=0):
            net.inp.weight.data.fill_(0.5)
        full[mode] = dsfunc.full_params(engine.state)
    assert (full["optimizer"]["inp.weight"] == 0.5).all()
    assert relative_diff(full["optimizer"], full["none"]) < 1e-6


def test_a_deepspeed_checkpoint_resumes_into_an_offloaded_state(tmp_path):
    """DeepSpeed's ZeRO-2 fp32 checkpoint (2 ranks), resumed here on one rank with the optimizer offloaded:
    the next steps equal DeepSpeed's own resume (its Adam and torch's CPU Adam agree to 1e-5)."""
    from tests.checkpoint.deepspeed.common import CASES, RESUMED, SAVE_AT, Net, batch, extract

    case = next(c for c in CASES if c.name == "s2_w2_fp32")
    root = extract(tmp_path)
    cfg = case.config(world=1, stage=2)
    cfg["zero_optimization"]["offload_optimizer"] = OPTIMIZER
    torch.manual_seed(1)
    state, _ = dsfunc.load_checkpoint(root / case.name, dsfunc.init_state(Net(), cfg))
    assert all(p.device.type == "cpu" for p in state.params.values()) and host_of(state) is not None
    losses = []
    for step in range(SAVE_AT, SAVE_AT + RESUMED):
        state = dsfunc.train_step(state, batch(step))
        losses.append(state.metrics.loss.item())
    reference = torch.load(root / case.name / "reference.pt")
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"])) < 1e-5
    full = dsfunc.full_params(state)
    assert relative_diff({k: full[k] for k in reference["params"]}, reference["params"]) < 1e-5


def test_parameter_groups_update_on_the_host_with_their_own_options():
    """One group through torch's CPU Adam, one without bias correction through dsfunc's op on the host."""
    groups = dsfunc.ParamGroups(label=lambda name: "bias" if name.endswith("bias") else "weight",
                                options={"bias": {"bias_correction": False, "weight_decay": 0.0, "lr": 3e-3}})
    full = {}
    for mode in ("none", "optimizer"):
        torch.manual_seed(0)
        cfg = config(micro=4, stage=1, gradient_clipping=0.05)
        cfg["zero_optimization"].update(MODES[mode])
        state = dsfunc.init_state(MLP(width=10, depth=3), cfg, param_groups=groups)
        for batch in mlp_batches(STEPS, 4):
            state = dsfunc.train_step(state, batch)
        full[mode] = dsfunc.full_params(state)
    assert relative_diff(full["optimizer"], full["none"]) < 1e-6


@pytest.mark.parametrize(
    ("grad", "comm", "ways", "expected"),
    [
        (torch.bfloat16, torch.float32, 1, torch.bfloat16),  # one rank: the reduction is the identity
        (torch.bfloat16, torch.float32, 2, torch.float32),  # a sum of two bf16 numbers needs fp32
        (torch.bfloat16, torch.bfloat16, 2, torch.bfloat16),  # summed in bf16 by the collective
        (torch.float32, torch.bfloat16, 1, torch.bfloat16),  # rounded to bf16 on the way in
        (torch.float16, torch.bfloat16, 1, torch.float32),  # fp16 rounded to bf16: neither holds it
        (torch.float32, torch.float32, 1, torch.float32),
    ],
)
def test_exact_dtype_is_the_narrowest_that_holds_a_reduced_gradient(grad, comm, ways, expected):
    from dsfunc.zero.reduce import exact_dtype

    assert exact_dtype(grad, comm, ways) == expected


def sixteen_bit_grads(rank: int, world: int) -> dict:
    """bf16, Lamb (a chain update: the same arithmetic offloaded or not), fp32 and bf16 communication, with
    and without accumulation: the parameters and what the host gradient buffers hold."""
    out = {}
    lamb = {"type": "Lamb", "params": {"lr": 1e-2}}
    for comm, gas in (("fp32", 1), ("bf16", 1), ("fp32", 2)):
        for stage in (2, 3):
            for mode in MODES if stage == 3 else ("none", "optimizer"):
                state = make_state(world, stage, mode, micro=4 // gas, gas=gas, optimizer=lamb,
                                   bf16={"enabled": True}, communication_data_type=comm)
                estimate = memory_estimate(state)["host_buffers"]
                state = train(state, rank, world)
                offload = host_of(state)
                held = None if offload is None else {
                    "dtypes": offload.grads.dtypes(),
                    "bytes": sum(t.nbytes for t in offload.buffers()),
                    "estimate": estimate,
                }
                out[(comm, gas), stage, mode] = {"full": dsfunc.full_params(state), "held": held}
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_host_gradients_are_16_bit_where_that_is_exact_and_train_bit_for_bit(world):
    for r in run_world(sixteen_bit_grads, world):
        for ((comm, gas), stage, mode), got in r.items():
            if mode == "none":
                continue
            assert relative_diff(got["full"], r[(comm, gas), stage, "none"]["full"]) == 0.0, (comm, gas, stage, mode)
            narrow = gas == 1 and (world == 1 or comm == "bf16")  # a sum of micro-batches needs fp32
            assert got["held"]["dtypes"] == {torch.bfloat16 if narrow else torch.float32}, (comm, gas, stage, mode)
            assert got["held"]["bytes"] == got["held"]["estimate"]  # the start-up estimate is what is held


def test_another_backward_of_the_last_micro_batch_adds_to_the_offloaded_gradient():
    from dsfunc.zero.runtime import zero_runtime

    grads = {}
    for mode in ("none", "optimizer"):
        state = make_state(1, 2, mode, micro=4, gas=1, bf16={"enabled": True})
        runtime = zero_runtime(state)
        batch = mlp_batches(1, 4)[0]
        first = runtime.forward(lambda model, b: model(*b), batch, micro=(0, 1))
        runtime.backward(first, retain_graph=True)
        runtime.backward(first * 3)  # the unit's gradient lands on the host, then three times more is added
        runtime.end()
        _, grads[mode] = runtime.finish()
    for name, reference in grads["none"].items():
        assert grads["optimizer"][name].device.type == "cpu"
        torch.testing.assert_close(grads["optimizer"][name].float(), reference, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_with_accumulation_no_gradient_waits_on_the_device_between_micro_batches(stage):
    from dsfunc.zero.runtime import zero_runtime

    grads = {}
    for mode in ("none", "optimizer"):
        state = make_state(1, stage, mode, micro=2, gas=3, bf16={"enabled": True})
        runtime = zero_runtime(state)
        for i, micro in enumerate(mlp_batches(3, 2)):
            runtime.backward(runtime.forward(lambda model, b: model(*b), micro, micro=(i, 3)))
            runtime.end()
            if mode == "optimizer":
                assert not runtime.reducer._grads  # every unit's sum so far is on the host
                # the first micro-batch's sums, bf16 on one rank, go out as they are; later sums are fp32
                held = host_of(state).grads.dtypes()
                assert held == {torch.bfloat16 if i == 0 else torch.float32}, i
        _, grads[mode] = runtime.finish()
    for name, reference in grads["none"].items():
        assert grads["optimizer"][name].device.type == "cpu" and grads["optimizer"][name].dtype == torch.float32
        torch.testing.assert_close(grads["optimizer"][name], reference, rtol=0, atol=0)


def test_adamw_on_16_bit_host_gradients_trains_like_the_run_on_the_device():
    """bf16, one micro-batch on one rank: the host Adam reads the bf16 gradients as they are (the CPU kernel
    widens them in registers)."""
    full = {}
    for mode in ("none", "optimizer"):
        state = train(make_state(1, 2, mode, micro=4, gas=1, bf16={"enabled": True}), 0, 1)
        full[mode] = dsfunc.full_params(state)
    offload = host_of(state)
    assert offload.grads.dtypes() == {torch.bfloat16}
    assert relative_diff(full["optimizer"], full["none"]) < 1e-5


def sums_on_the_device(rank: int, world: int) -> dict:
    """Three micro-batches a step, the last two units' sums kept on the device between them: the units each
    micro-batch leaves on the device, and the parameters after training (Lamb: the same arithmetic offloaded
    or not)."""
    from dsfunc.monitor.progress import startup_summary
    from dsfunc.zero.runtime import zero_runtime

    lamb = {"type": "Lamb", "params": {"lr": 1e-2}}
    plan = make_state(world, 2, "optimizer", micro=1, gas=3).program.plan
    budget = sum(plan.shard_size(u) for u in plan.units[-2:])
    out = {}
    for stage in (2, 3):
        for device_sums in (0, budget):
            state = make_state(world, stage, "optimizer", micro=1, gas=3, optimizer=lamb, device_sums=device_sums)
            runtime = zero_runtime(state)
            waiting = []
            for i, micro in enumerate(mlp_batches(3, world)):
                x, y = micro[0][rank : rank + 1], micro[1][rank : rank + 1]
                runtime.backward(runtime.forward(lambda model, b: model(*b), (x, y), micro=(i, 3)))
                runtime.end()
                waiting.append(sorted(runtime.reducer._grads))
            runtime.finish()
            trained = train(make_state(world, stage, "optimizer", micro=1, gas=3, optimizer=lamb, device_sums=device_sums),
                            rank, world)
            offload = host_of(trained)
            out[stage, device_sums] = {
                "waiting": waiting, "kept": sorted(host_of(state).device_sums.units),
                "host buffers": sorted(offload.grads._storage), "bytes": sum(t.nbytes for t in offload.buffers()),
                "host estimate": memory_estimate(trained)["host_buffers"],
                "estimate": memory_estimate(state)["gradients"], "full": dsfunc.full_params(trained),
                "summary": startup_summary(state),
                "grad_norm": trained.metrics.grad_norm.item(),
            }
    out["last two"] = sorted(u.name for u in plan.units[-2:])
    out["budget"] = budget
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_sums_kept_on_the_device_between_micro_batches_train_bit_for_bit(world):
    for r in run_world(sums_on_the_device, world):
        for stage in (2, 3):
            kept, sent = r[stage, r["budget"]], r[stage, 0]
            assert kept["kept"] == r["last two"] and sent["kept"] == []
            # only the chosen units' sums wait on the device, after the last micro-batch too (for the update)
            assert kept["waiting"] == [r["last two"]] * 3 and sent["waiting"] == [[], [], []]
            assert kept["estimate"] == 4 * r["budget"] and sent["estimate"] == 0
            # ... so they have no host gradient buffer: they are read through two host buffers, which the estimate counts
            assert kept["host buffers"] == sorted(set(sent["host buffers"]) - set(r["last two"]))
            assert kept["bytes"] == kept["host estimate"] and sent["bytes"] == sent["host estimate"]
            assert "the gradient sums of 2 unit(s) wait on the device" in kept["summary"]
            assert "wait on the device" not in sent["summary"]
            assert relative_diff(kept["full"], sent["full"]) == 0.0 and kept["grad_norm"] == sent["grad_norm"]


def test_sums_on_the_device_say_when_they_cannot_apply(caplog):
    with caplog.at_level("WARNING", logger="dsfunc"):
        assert not make_state(1, 1, "optimizer", device_sums=10**9).program.run.grads.device_sums.units
        assert "has no effect at stage 1" in caplog.text
        assert not make_state(1, 2, "optimizer", device_sums=1).program.run.grads.device_sums.units
        assert "= 1 is smaller than every unit's gradient shard" in caplog.text


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_sums_kept_on_the_device_reach_the_host_adam_through_two_buffers(stage, gas):
    """Three of four units keep their gradients on the device until the host Adam reads them, each copied into
    one of two host buffers as the update reaches it: the same parameters bit for bit, and no host gradient
    buffer for those units (without accumulation too: the bf16 gradient waits there)."""
    on_device = 3 * 110
    full, offloads = {}, {}
    for device_sums in (0, on_device):
        state = make_state(1, stage, "optimizer", micro=4 // gas, gas=gas, device_sums=device_sums, bf16={"enabled": True})
        state = train(state, 0, 1)
        full[device_sums], offloads[device_sums] = dsfunc.full_params(state), host_of(state)
        assert sum(t.nbytes for t in offloads[device_sums].buffers()) == memory_estimate(state)["host_buffers"]
    kept = offloads[on_device]
    assert sorted(kept.device_sums.units) == ["blocks.0", "blocks.1", "blocks.2"]
    assert sorted(kept.grads._storage) == ["root"] and len(kept.device_sums.buffers.all) == 2  # reused, unit after unit
    # without accumulation the new bf16 shards go out of the gradients' own buffers: no staging buffers
    assert all(len(o.staging._buffers) == (0 if gas == 1 else 3) and o.staging.over_grads == (gas == 1)
               for o in offloads.values())
    assert relative_diff(full[on_device], full[0]) == 0.0


def test_the_engine_keeps_sums_on_the_device_until_its_accumulation_boundary():
    """The engine's backward per micro-batch and step at the boundary run the same runtime: bit for bit."""
    import dsfunc as deepspeed

    full = {}
    for sums in ({}, {"grad_accumulation_on_device": 250}):  # two of the 110-element blocks
        torch.manual_seed(0)
        net = MLP(width=10, depth=3)
        cfg = config(micro=1, gas=4, stage=3, gradient_clipping=0.05)
        cfg["zero_optimization"].update(offload_optimizer={**OPTIMIZER, **sums}, stage3_param_persistence_threshold=0)
        engine, _, _, _ = deepspeed.initialize(model=net, config=cfg)
        waiting = []
        for x, y in mlp_batches(3, 4):
            for i in range(4):
                engine.backward(engine(x[i : i + 1], y[i : i + 1]))
                engine.step()
                runtime = engine.steps.runtime
                waiting.append(len(runtime.reducer._grads) if runtime is not None else None)
        # between the micro-batches of a step the two units' sums wait on the device; the boundary ends the step
        assert waiting == ([2 if sums else 0] * 3 + [None]) * 3, waiting
        full[bool(sums)] = dsfunc.full_params(engine.state)
    assert relative_diff(full[True], full[False]) == 0.0


def test_only_init_state_reaches_into_the_offload_package():
    """Offload is a policy: outside dsfunc/zero/offload/ the step sees it only through dsfunc.zero.policy, and only
    init_state (which reads the config) imports the package."""
    import ast

    root = Path(dsfunc.__file__).parent
    importers = set()
    for path in root.rglob("*.py"):
        if path.is_relative_to(root / "zero" / "offload"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n == "dsfunc.zero.offload" or n.startswith("dsfunc.zero.offload.") for n in names):
                importers.add(path.relative_to(root).as_posix())
    assert importers == {"init.py"}


def test_the_offload_packages_names_appear_nowhere_else():
    """Nothing outside dsfunc/zero/offload/ names what it defines (its classes, functions and constants) but
    init_state's one call of ``placement``: the rest of the package knows offload only as the policies."""
    import ast

    root = Path(dsfunc.__file__).parent
    package = root / "zero" / "offload"
    defined = set()
    for path in package.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
    defined -= {"__all__", "logger", "placement"}  # every module's own; placement is checked by its import above
    assert {"HostOffload", "HostRunner", "ShardStaging", "DeviceSums", "HostExecutor"} <= defined
    named = set()
    for path in root.rglob("*.py"):
        if path.is_relative_to(package):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute)
                     else [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else [])
            named.update(f"{path.relative_to(root).as_posix()}: {n}" for n in names if n in defined)
    assert not named, sorted(named)
