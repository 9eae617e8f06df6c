"""``offload_optimizer.speculative_update``: each unit's host update runs ahead of the step, as its gradient lands,
and the run is bit for bit the run without it: on steps that clip, skip (an overflow) or neither, with
accumulation, at stages 2 and 3 on 1 and 2 gloo ranks, for the fused Adam of fp32 masters and the chain of bf16
masters (``bf16_master_weights_and_grads``: SGD with momentum, AdamW with Kahan's compensation). Each step also
says which units' speculative update stood (neither clipped nor skipped) and which were undone and redone, so a
run that never speculated, or never redid, cannot pass.
"""

from __future__ import annotations

import optree
import pytest
import torch

import dsfunc
from dsfunc.config import ConfigError
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

STEPS = 4
POISON = 2  # the fp16 case's step whose input holds an inf on rank 0
CLIP = 1.5  # inside the MLP's gradient norms on these batches: some steps clip, others do not
# name -> (optimizer type, gradient_clipping, accumulation steps, precision, an inf in rank 0's input at POISON)
CASES = {
    "adamw": ("AdamW", 0.0, 1, "fp32", False),
    "adamw accumulated": ("AdamW", 0.0, 2, "fp32", False),
    "adam clipped": ("Adam", CLIP, 2, "fp32", False),
    "fp16 overflow": ("AdamW", CLIP, 2, "fp16", True),
    "bf16 sgd clipped": ("SGD", CLIP, 2, "bf16", False),
    "bf16 kahan overflow": ("AdamW", CLIP, 2, "kahan", True),
}
PRECISION = {
    "fp32": {},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
    **{name: {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True,
                       "rounding": rounding}} for name, rounding in (("bf16", "nearest"), ("kahan", "kahan"))},
}
PARAMS = {"SGD": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01}}


def make_state(world: int, stage: int, case: str, speculative: bool) -> dsfunc.TrainState:
    optimizer, clip, gas, precision, _ = CASES[case]
    torch.manual_seed(0)
    params = PARAMS.get(optimizer, {"lr": 1e-2, "weight_decay": 0.01})
    cfg = config(micro=2, gas=gas, world=world, stage=stage, gradient_clipping=clip,
                 optimizer={"type": optimizer, "params": params},
                 scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3}}, **PRECISION[precision])
    offload = {"device": "cpu", "speculative_update": speculative}
    cfg["zero_optimization"].update(offload_optimizer=offload, stage3_param_persistence_threshold=0)
    return dsfunc.init_state(MLP(width=10, depth=3), cfg)


def train(state: dsfunc.TrainState, rank: int, world: int, poison: bool) -> tuple[dsfunc.TrainState, list]:
    """``STEPS`` steps; per step, the number of units whose speculative update stood, were undone and had not
    begun when the norm was known (only where the compute device is a GPU: on the CPU each update begins as
    its gradient lands), and the step's gradient norm."""
    n = state.program.config.train_micro_batch_size_per_gpu * state.program.config.gradient_accumulation_steps
    outcomes = []
    for i, (x, y) in enumerate(mlp_batches(STEPS, n * world)):
        x, y = x[rank * n : (rank + 1) * n].clone(), y[rank * n : (rank + 1) * n]
        if poison and i == POISON and rank == 0:
            x[0, 0] = float("inf")
        state = dsfunc.train_step(state, (x, y))
        speculation = state.program.run.runner.speculation
        outcomes.append(None if speculation is None else (len(speculation.stood), len(speculation.undone),
                                                          len(speculation.late), state.metrics.grad_norm.item()))
    return state, outcomes


def both_runs(rank: int, world: int) -> dict:
    out = {}
    for stage in (2, 3):
        for case in CASES:
            runs = {}
            for speculative in (False, True):
                state, outcomes = train(make_state(world, stage, case, speculative), rank, world, CASES[case][4])
                state.program.run.wait()
                metrics = state.metrics
                runs[speculative] = {
                    "params": dict(state.params), "opt_state": optree.tree_leaves(state.opt_state),
                    "metrics": [metrics.loss, metrics.grad_norm, metrics.loss_scale, metrics.lr, metrics.skipped],
                    "scaler": optree.tree_leaves(state.scaler), "outcomes": outcomes,
                    "units": sum(1 for n, p in state.params.items() if p.numel() > 0),
                }
            out[stage, case] = runs
    return out


def same(a: list | dict, b: list | dict) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("world", [1, 2])
def test_the_speculative_update_is_bit_for_bit_the_update(world):
    outcomes = {case: set() for case in CASES}  # whether each case had steps that clip or skip, and others
    for rank, results in enumerate(run_world(both_runs, world)):
        for (stage, case), runs in results.items():
            where = f"world {world} rank {rank} stage {stage} {case}"
            plain, ahead = runs[False], runs[True]
            for part in ("params", "opt_state", "metrics", "scaler"):
                assert same(plain[part], ahead[part]), f"{where}: {part} differ"
            assert plain["outcomes"] == [None] * STEPS
            units, clip = ahead["units"], CASES[case][1]
            for step, (stood, undone, late, norm) in enumerate(ahead["outcomes"]):
                wrong = (clip > 0 and norm + 1e-6 > clip) or (CASES[case][4] and step == POISON)
                # a step that clips or skips redoes every unit; any other keeps every unit's speculative update
                ran = units - late
                assert (stood, undone) == ((0, ran) if wrong else (ran, 0)), (where, step, ahead["outcomes"])
                assert late == 0 or torch.cuda.is_available(), (where, step, ahead["outcomes"])
                outcomes[case].add(wrong)
            assert sum(units - late for *_, late, _ in ahead["outcomes"]) > 0, (where, ahead["outcomes"])
    assert all(outcomes[case] == {False, True} for case in CASES if CASES[case][1] > 0), outcomes
    assert all(outcomes[case] == {False} for case in ("adamw", "adamw accumulated")), outcomes


def ordered(rank: int, world: int, case: str) -> dict:
    state, _ = train(make_state(world, 3, case, True), rank, world, poison=False)
    host = state.program.run.runner.host
    return {"log": list(host.speculation.log), "spare": host.speculation.host_bytes(),
            "elements": sum(p.numel() for p in state.params.values()),
            "units": [n for n, p in state.params.items() if p.numel() > 0]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU put() does not wait for the update to begin: which "
                    "units run ahead is the timing's (the late units: test_the_speculative_update_is_bit_for_bit...)")
@pytest.mark.parametrize(("case", "spare"), [("adamw accumulated", 12), ("bf16 kahan overflow", 8)])
def test_each_unit_s_update_starts_as_its_gradient_lands_before_the_norm_is_known(case, spare):
    """The executor's log of the last step: each unit's update began after its gradient landed and before the
    step's scalars were known, the first before the last gradient landed (during backward). The spare buffers
    are the size of what the update writes: the fp32 master and both Adam moments, 12 host bytes a parameter; in
    bf16 the master, its Kahan compensation and the moments, 8."""
    (r,) = run_world(ordered, 1, case)
    log = r["log"]
    known = log.index(("known", ""))
    for unit in r["units"]:
        assert log.index(("landed", unit)) < log.index(("start", unit)) < known, log
    first_start = min(i for i, (what, _) in enumerate(log) if what == "start")
    last_landed = max(i for i, (what, _) in enumerate(log) if what == "landed")
    assert first_start < last_landed, log
    assert r["spare"] == spare * r["elements"]


def test_deepspeed_s_super_offload_turns_it_on_and_its_cores_share_is_refused():
    base = config(micro=2, stage=2)
    base["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "super_offload": True}
    state = dsfunc.init_state(MLP(width=10, depth=3), base)
    assert state.program.run.runner.speculation is not None
    base["zero_optimization"]["offload_optimizer"]["cpuadam_cores_perc"] = 0.5
    with pytest.raises(ConfigError, match="cpuadam_cores_perc = 0.5"):
        dsfunc.init_state(MLP(width=10, depth=3), base)


def test_a_second_backward_of_the_last_micro_batch_undoes_and_restarts_the_speculative_update():
    """The gradient a unit's update ran ahead with is replaced (another backward adds to it): that update is
    undone before the buffer is written, and the unit's update starts again from the new sum."""
    from dsfunc.zero.runtime import zero_runtime

    params = {}
    for speculative in (False, True):
        state = make_state(1, 2, "adamw", speculative)
        runner = state.program.run.runner
        runner.expect(state, state.program.update)  # what train_step does before its backward
        runtime = zero_runtime(state)
        batch = mlp_batches(1, 2)[0]
        loss = runtime.forward(lambda model, b: model(*b), batch, micro=(0, 1))
        runtime.backward(loss, retain_graph=True)
        runtime.backward(loss * 3)
        runtime.end()
        _, grads = runtime.finish()
        state = dsfunc.apply_gradients(state, grads, loss.detach())
        state.program.run.wait()
        params[speculative] = dict(state.params)
        if speculative:
            units = set(state.params)
            assert runner.speculation.undone == units and runner.speculation.stood == units
            starts = [name for what, name in runner.speculation.log if what == "start"]
            assert sorted(starts) == sorted(list(units) * 2)
    assert same(params[False], params[True])


def test_a_budget_of_elements_runs_ahead_only_the_units_it_holds_bit_for_bit():
    """``speculative_update: N``: only whole units within N elements run ahead (the first whose gradients land),
    their spare buffers alone are made, and the rest wait for the step: still bit for bit the plain update."""
    sizes = {n: p.numel() for n, p in make_state(1, 2, "adamw", False).params.items()}
    budget = max(sizes.values())  # room for the largest unit alone: some units run ahead, not all
    runs = {}
    for speculative in (False, budget):
        state, _ = train(make_state(1, 2, "adamw", speculative), 0, 1, poison=False)
        state.program.run.wait()
        runs[speculative] = state
    speculation = runs[budget].program.run.runner.speculation
    ahead = {name for what, name in speculation.log if what == "start"}
    assert ahead and ahead == speculation.stood and len(ahead) < len(sizes)
    assert sum(sizes[n] for n in ahead) <= budget
    assert speculation.host_bytes() == 12 * sum(sizes[n] for n in ahead)
    assert same(dict(runs[False].params), dict(runs[budget].params))
    assert same(optree.tree_leaves(runs[False].opt_state), optree.tree_leaves(runs[budget].opt_state))


def test_units_whose_update_has_not_begun_when_the_norm_is_known_are_the_step_s_bit_for_bit():
    """A worker behind backward (here: held until the step's scalars are known) starts no update ahead of the step
    after that: those units are updated by the step, as without speculation, neither kept nor redone."""
    import threading

    runs = {}
    for speculative in (False, True):
        state = make_state(1, 3, "adamw accumulated", speculative)
        speculation = state.program.run.runner.speculation
        if speculative:
            speculation._wait_start = False  # as on a GPU: put() does not wait for the update to begin
            gate, known = threading.Event(), speculation.known

            def release_after_known(known=known, gate=gate):
                known()
                gate.set()

            speculation.known = release_after_known
        lates = []
        for x, y in mlp_batches(2, 4):
            if speculative:
                gate.clear()
                speculation._executor.submit(gate.wait)  # the worker is busy until the norm is known
            state = dsfunc.train_step(state, (x, y))
            if speculative:
                lates.append((len(speculation.late), len(speculation.stood), len(speculation.undone)))
        state.program.run.wait()
        runs[speculative] = state
        if speculative:
            units = sum(1 for p in state.params.values() if p.numel() > 0)
            assert lates == [(units, 0, 0)] * 2, lates
    assert same(dict(runs[False].params), dict(runs[True].params))
    assert same(optree.tree_leaves(runs[False].opt_state), optree.tree_leaves(runs[True].opt_state))


def test_a_view_of_a_master_held_across_steps_sees_the_update_as_without_speculation():
    """A stood update is exchanged into the state; where something else holds a view of a state tensor (a notebook's
    slice of a master, say) its values are copied in instead: the view reads what the in-place update writes."""
    views = {}
    for speculative in (False, True):
        state = make_state(1, 2, "adamw", speculative)
        name, view = next(n for n, p in state.params.items() if p.numel() > 0), None
        for x, y in mlp_batches(3, 2):
            state = dsfunc.train_step(state, (x, y))
            if view is None:  # the masters the update writes, from the first step on
                view = state.params[name][:5]
        state.program.run.wait()
        if speculative:
            assert name in state.program.run.runner.speculation.stood
        assert torch.equal(view, state.params[name][:5])
        views[speculative] = view.clone()
    assert torch.equal(views[False], views[True])
