"""Checkpointed inputs offloaded to host memory (``cpu_checkpointing``) and prefetched back: the bookkeeping, run
without a GPU by an offloader whose "device" is the CPU (its copies are then synchronous, the order the same)."""

from __future__ import annotations

import gc

import pytest
import torch

import dsfunc
from dsfunc import remat
from dsfunc.activation_offload import ActivationOffloader
from dsfunc.config import ActivationCheckpointingConfig, parse_activation_checkpointing
from tests.models import relative_diff
from tests.zero.test_backward_by_units import gpt, outcome, tokens

CPU = ActivationCheckpointingConfig(policy="units", cpu_checkpointing=True)


def chain(offloader: ActivationOffloader, x: torch.Tensor, layers: list[torch.nn.Linear],
          cut: bool = False) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``x`` through ``layers``, each a checkpointed call saving its input and a small scale (which stays put); with
    ``cut``, each call's input is a leaf detached from the previous output (as the backward by units does)."""
    scale = torch.full((1,), 0.5)
    cuts = []
    for layer in layers:
        if cut:
            leaf = x.detach().requires_grad_()
            cuts.append((x, leaf))
            x = leaf
        x = remat.checkpoint(lambda v, s, lin=layer: torch.tanh(lin(v)) * s, x, scale, options=CPU,
                             offloader=offloader)
    return x, cuts


def layers(n: int = 4) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(64, 64) for _ in range(n)]


def test_each_call_prefetches_the_one_before_it_and_the_pool_is_reused_across_steps():
    offloader = ActivationOffloader("cpu", min_bytes=1024)
    model = layers()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    out, _ = chain(ActivationOffloader("cpu", min_bytes=2**30), x.requires_grad_(), model)  # nothing offloaded
    expected = torch.autograd.grad(out.sum(), [x, *model[0].parameters()])
    for step in range(3):
        out, _ = chain(offloader, x, model)
        assert offloader.pool.in_use == 4 * 8 * 64 * 4  # the four inputs, not the scales (below min_bytes)
        got = torch.autograd.grad(out.sum(), [x, *model[0].parameters()])
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        del out
        # the last call's backward came first and copied back as it began; each began the copy of the one before
        assert (offloader.prefetched, offloader.consumed) == (3 * (step + 1), 3 * (step + 1))
        assert offloader.pool.in_use == 0 and offloader.pool.held == 4 * 8 * 64 * 4, step
    out, _ = chain(offloader, torch.randn(16, 64, requires_grad=True), model)  # other sizes: the old ones go
    out.sum().backward()
    assert offloader.pool.in_use == 0 and offloader.pool.held == 4 * 16 * 64 * 4


def test_micro_batches_whose_backward_runs_jointly_get_their_own_prefetches():
    """Two micro-batches' forwards, then their backward call by call from the last, one micro-batch after the
    other (the backward by units): each micro-batch's first call backward copies back as it begins, the rest are
    prefetched, and the copies back of one micro-batch do not stand in for the other's."""
    offloader = ActivationOffloader("cpu", min_bytes=1024)
    model = layers(3)
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    runs = [chain(offloader, x, model, cut=True) for x in xs]
    roots = [[(out, torch.ones_like(out))] for out, _ in runs]
    for c in reversed(range(3)):
        for m, (_, cuts) in enumerate(runs):
            (t, g), = roots[m]
            torch.autograd.backward([t], [g])
            if c:
                t, leaf = cuts[c]
                roots[m] = [(t, leaf.grad)]
    assert (offloader.prefetched, offloader.consumed) == (4, 4)
    reference = [layer.weight.grad.clone() for layer in model]
    for layer in model:
        layer.weight.grad = None
    for x in xs:
        out, _ = chain(ActivationOffloader("cpu", min_bytes=2**30), x, model)
        out.sum().backward()
    assert all(torch.equal(layer.weight.grad, r) for layer, r in zip(model, reference))
    del runs, roots
    assert offloader.pool.in_use == 0


def test_a_call_whose_backward_never_runs_gives_its_buffers_back():
    """The third call reads the second's output detached: its backward prefetches the second call's input, which
    no backward consumes, and the buffers come back when the second call's graph goes."""
    offloader = ActivationOffloader("cpu", min_bytes=1024)
    model = layers(3)
    first, _ = chain(offloader, torch.randn(8, 64), model[:2])
    out, _ = chain(offloader, first.detach(), model[2:])
    out.sum().backward()
    assert (offloader.prefetched, offloader.consumed) == (1, 0)
    assert offloader.pool.in_use == 8 * 64 * 4 * 2  # the first two calls' inputs, still in their graph
    del first
    gc.collect()
    assert offloader.pool.in_use == 0


def test_device_checkpoints_needs_cpu_checkpointing():
    with pytest.raises(dsfunc.ConfigError, match="device_checkpoints = 2 .* cpu_checkpointing is false .*: set cpu_checkpointing"):
        parse_activation_checkpointing({"policy": "units", "device_checkpoints": 2})
    with pytest.raises(dsfunc.ConfigError, match="device_checkpoints = -1 is invalid"):
        parse_activation_checkpointing({"policy": "units", "cpu_checkpointing": True, "device_checkpoints": -1})


@pytest.mark.parametrize("every, kept", [(1, [False, False, True, True]), (2, [False, None, True, None])])
def test_the_last_device_checkpoints_units_keep_their_inputs_on_the_device(every, kept):
    from tests.test_remat import config
    from tests.test_remat import gpt as gpt4

    model = gpt4()
    section = {"policy": "units", "every": every, "cpu_checkpointing": True, "device_checkpoints": 2 if every == 1
               else 1}
    dsfunc.init_state(model, config(0, section), in_place=True)
    got = [None if "forward" not in b.__dict__ else not b.forward.keywords["options"].cpu_checkpointing
           for b in model.blocks]
    assert got == kept


def test_the_backward_by_units_trains_bit_for_bit_with_offloaded_checkpoints(monkeypatch):
    """ZeRO-3, optimizer offload, 4 micro-batches a step in joint backwards of 2, the unit inputs offloaded by an
    offloader whose device is the CPU: as without checkpointing; every prefetch consumed, no buffer left in use."""
    from tests.models import config

    offloaders = []

    def offloader_for(options):
        offloaders.append(ActivationOffloader("cpu", min_bytes=0) if options.cpu_checkpointing else None)
        return offloaders[-1]

    monkeypatch.setattr(remat, "offloader_for", offloader_for)

    def run(section: dict) -> tuple:
        offload = {"device": "cpu", "micro_batches_per_backward": 2}
        cfg = config(micro=2, gas=4, stage=3, gradient_clipping=1.0, activation_checkpointing=section)
        cfg["zero_optimization"].update(offload_optimizer=offload, stage3_param_persistence_threshold=0)
        state = dsfunc.init_state(gpt(dropout=0.1), cfg, device="cpu")
        for idx, tgt in tokens(2, 8):
            state = dsfunc.train_step(state, (idx, tgt))
        return outcome(state)

    reference = run({"policy": "none"})
    params, loss, norm = run({"policy": "units", "cpu_checkpointing": True, "device_checkpoints": 1})
    assert relative_diff(params, reference[0]) == 0.0 and (loss, norm) == reference[1:]
    _, offloader = offloaders
    # 3 units, the last kept: 2 offload a micro-batch, the second prefetching the first (2 steps of 4 micro-batches)
    assert offloader.prefetched == offloader.consumed == 2 * 4
    assert offloader.pool.in_use == 0
