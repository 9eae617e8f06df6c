"""The host's native bf16 Adam (``dsfunc_cpu::adam_bf16_step_``, chosen by :mod:`dsfunc.optim.low_precision_host`)
against the torch chain it replaces: bit for bit, for the masters, moments and Kahan compensations."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import optree
import pytest
import torch

import dsfunc
from dsfunc.kernels.native import native_ready
from dsfunc.optim.update import UpdateContext
from tests.models import MLP, mlp_batches
from tests.optim.test_low_precision import MICRO, bf16_config

pytestmark = pytest.mark.skipif(not native_ready("cpu"), reason="dsfunc's CPU kernels did not build")

ADAM_L2 = {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-5, "weight_decay": 0.05, "adam_w_mode": False,
           "bias_correction": False}


class _Recording:
    """A host executor that runs each unit's work at once and keeps the works it ran."""

    on_host = True

    def __init__(self) -> None:
        self.works = []

    def run(self, names: list[str], work) -> None:
        self.works.append(work)
        for name in names:
            work([name])

    def unit_done(self, name: str, master: torch.Tensor) -> None:
        """Nothing waits."""


@pytest.mark.parametrize(("optimizer", "rounding", "grad_dtype"),
                         [("AdamW", "nearest", torch.bfloat16), ("Adam", "kahan", torch.float32),
                          ("AdamW", "kahan", torch.bfloat16)])
def test_the_native_update_is_the_torch_chain_bit_for_bit(optimizer, rounding, grad_dtype):
    """Units of odd lengths (one spread over two threads), 5 steps with the clip active, a loss scale, an lr set
    by the caller, and one step skipped (non-finite): masters, moments and compensations equal the torch chain's
    on the host, for AdamW (decoupled decay) and Adam with L2 decay and no bias correction."""
    cfg = bf16_config(2, "AdamW", rounding)
    if optimizer == "Adam":
        cfg["optimizer"] = {"type": "Adam", "params": ADAM_L2}
    cfg = dsfunc.Config.load({**cfg, "train_batch_size": MICRO})
    native = dsfunc.optim.update_from_config(cfg)
    assert native.native is not None and native.native.kahan == (rounding == "kahan")
    g = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(70001, generator=g).bfloat16(), "b": torch.randn(37, generator=g).bfloat16()}
    runs = {}
    for update in (native, dataclasses.replace(native, native=None)):
        params, g = {k: v.clone() for k, v in start.items()}, torch.Generator().manual_seed(1)
        state, executor = update.init(params), _Recording()
        for step in range(5):
            grads = {k: (torch.randn(v.shape, generator=g) * 64).to(grad_dtype) for k, v in params.items()}
            norm = torch.sqrt(sum(x.float().pow(2).sum() for x in grads.values())) / 64
            finite = torch.tensor(step != 2)
            ctx = UpdateContext(loss_scale=torch.tensor(64.0), grad_norm=norm, grad_scale=torch.tensor(1 / 64),
                                finite=finite, skip=~finite, lowp={}, segment_norm=None, executor=executor,
                                lr={None: 0.003} if step == 4 else None)
            params, state = update.apply(params, grads, state, ctx)
            assert norm > cfg.gradient_clipping
        assert all((w.native is not None) is (update is native) for w in executor.works)
        runs[update is native] = (dict(params), optree.tree_leaves(state))
    assert not torch.equal(runs[True][0]["a"], start["a"])
    assert all(torch.equal(runs[False][0][k], runs[True][0][k]) for k in start)
    assert all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1], strict=True))


@pytest.mark.parametrize("rounding", ["nearest", "kahan"])
def test_zero_offload_with_the_native_update_trains_as_the_torch_chain(rounding):
    """ZeRO-2 Offload with bf16 masters, moments and gradients, 3 steps, clipped: the native host update and the
    torch chain (the same config's update without it) leave the same parameters, bit for bit."""
    cfg = bf16_config(2, "AdamW", rounding, offload=True)
    update = dsfunc.optim.update_from_config(dsfunc.Config.load({**cfg, "train_batch_size": MICRO}))
    assert update.native is not None
    full = {}
    for chain in (update, dataclasses.replace(update, native=None)):
        torch.manual_seed(0)
        state = dsfunc.init_state(MLP(width=10, depth=3), cfg, optimizer=chain)
        assert {p.device.type for p in state.params.values()} == {"cpu"}
        assert {p.dtype for p in state.params.values()} == {torch.bfloat16}
        for batch in mlp_batches(3, MICRO):
            state = dsfunc.train_step(state, batch)
        full[chain.native is None] = dsfunc.full_params(state)
    assert all(torch.equal(full[False][k], full[True][k]) for k in full[False])


def test_bench_host_adam_times_the_bf16_states_update():
    """``bench/bench_host_adam.py --bf16_states`` times the native kernel, the torch chain and the fp32 kernel."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-W", "ignore", str(root / "bench" / "bench_host_adam.py"), "--bf16_states",
           "--numel", "1003", "--threads", "1", "--repeat", "1"]
    proc = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 1 |")]
    assert [r[1].strip() for r in rows] == ["bf16 states, dsfunc native kernel", "bf16 states, torch chain",
                                            "fp32 states, dsfunc CPU kernel"], proc.stdout
    assert all(float(r[2]) > 0 for r in rows), proc.stdout
