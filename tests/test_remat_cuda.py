"""Activation memory with every unit checkpointed, on the BENCH.md 1.3b GPT, and checkpoints offloaded to pinned host
memory (GPU only)."""

from __future__ import annotations

import gc

import pytest
import torch

import dsfunc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def activation_peak(policy: str) -> float:
    """GiB allocated above the model states during one training step (micro-batch 8, sequence 1024)."""
    from dsfunc.models.gpt import GPT, GPTConfig, init_weights

    with torch.device("meta"):
        model = GPT(GPTConfig.preset("1.3b"))
    config = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "activation_checkpointing": {"policy": policy}}
    state = dsfunc.init_state(model, config, param_init_fn=init_weights)
    tokens = torch.randint(0, 50304, (8, 1025), device="cuda")
    state = dsfunc.train_step(state, (tokens[:, :-1], tokens[:, 1:]))  # the optimizer moments now exist
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state = dsfunc.train_step(state, (tokens[:, :-1], tokens[:, 1:]))
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    del state
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def test_checkpointing_every_unit_keeps_at_most_a_third_of_the_activations():
    none, units, selective = activation_peak("none"), activation_peak("units"), activation_peak("selective")
    print(f"activation peak GiB: none {none:.2f}, selective {selective:.2f}, units {units:.2f}")
    assert units <= none / 3, (none, units)
    assert units < selective < none, (none, selective, units)


@pytest.mark.parametrize("policy", ["units", "selective"])
def test_checkpointed_dropout_gradients_equal_the_unchecked_ones_with_fused_attention(policy):
    """CUDA's fused attention draws its dropout from the generator: the selective policy must not save it (a saved
    op is not rerun, so the dropouts after it would draw other masks in the recomputation)."""
    from tests.test_compile import batches, config, gpt

    def first_step(remat: str):
        cfg = {**config(0, 1, None), "gradient_accumulation_steps": 1, "activation_checkpointing": {"policy": remat}}
        state = dsfunc.init_state(gpt(dropout=0.1), cfg, seed=5)
        tokens, targets = batches(0, 1)[0]
        return dsfunc.train_step(state, (tokens[:2], targets[:2])).metrics

    plain, checkpointed = first_step("none"), first_step(policy)
    assert torch.equal(checkpointed.loss, plain.loss)
    assert torch.equal(checkpointed.grad_norm, plain.grad_norm)



def offloaded_steps(section: dict, per_backward: int, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """3 steps of a 6-block GPT (each block's input 2 MiB) at ZeRO-3 with the optimizer offloaded, 4 micro-batches a
    step in joint backwards of ``per_backward``; the loss, grad norm and parameters after, the last step's GPU peak
    above what it starts with, and the offloader (None without cpu_checkpointing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dsfunc import remat
    from dsfunc.models.gpt import GPT, GPTConfig, init_weights

    made = []
    real = remat.offloader_for
    monkeypatch.setattr(remat, "offloader_for", lambda options: made.append(real(options)) or made[-1])
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=512, n_layer=6, n_head=4, d_model=256, dropout=0.1))
    model.apply(init_weights)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "activation_checkpointing": section,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer":
                                 {"device": "cpu", "micro_batches_per_backward": per_backward}}}
    state = dsfunc.init_state(model, cfg, seed=3)
    gen = torch.Generator().manual_seed(1)
    peak = 0
    for _ in range(3):
        tokens = torch.randint(0, 64, (16, 513), generator=gen).cuda()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with sdpa_kernel(SDPBackend.MATH):  # its backward is deterministic (the fused kernels' need not be)
            state = dsfunc.train_step(state, (tokens[:, :-1], tokens[:, 1:]))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    outcome = (state.metrics.loss.item(), state.metrics.grad_norm.item(), dsfunc.full_params(state))
    return outcome, peak, next((m for m in made if m is not None), None)


@pytest.mark.parametrize("per_backward", [1, 2])
def test_offloaded_checkpoints_train_bit_for_bit_and_every_prefetch_is_used(per_backward, monkeypatch):
    """Offloaded, with the last 2 units kept, and all kept: the same training; with one backward a micro-batch, the
    offload lowers the GPU peak (in the joint backward of several, the unit inputs cut from the graph stay on the
    device anyway: see dsfunc.activation_offload)."""
    from tests.models import relative_diff

    (loss, norm, params), kept_peak, _ = offloaded_steps({"policy": "units"}, per_backward, monkeypatch)
    block = 4 * 512 * 256 * 4
    peaks = {}
    for n in (0, 2):
        section = {"policy": "units", "cpu_checkpointing": True, "device_checkpoints": n}
        (other_loss, other_norm, other), peaks[n], offloader = offloaded_steps(section, per_backward, monkeypatch)
        assert (other_loss, other_norm) == (loss, norm) and relative_diff(other, params) == 0.0, n
        offloaded = 6 - n
        # each micro-batch's first offloaded call backward copies back unprefetched, the others were prefetched
        assert offloader.prefetched == offloader.consumed == 3 * 4 * (offloaded - 1), n
        # the pool holds one backward's inputs, reused by the later ones and steps; pinned at their exact size
        assert offloader.pool.in_use == 0 and offloader.pool.held == per_backward * offloaded * block, n
        pinned = offloader.pool.memory.pinned
        assert len(pinned.registered) == per_backward * offloaded and not pinned.failed, n
    print(f"per_backward {per_backward}: GPU peak MiB, inputs kept {kept_peak / 2**20:.1f}, last 2 kept "
          f"{peaks[2] / 2**20:.1f}, all offloaded {peaks[0] / 2**20:.1f}")
    if per_backward == 1:  # 6 inputs of 2 MiB kept against about 2 (the one in backward, the one prefetched)
        assert max(peaks.values()) < kept_peak, (peaks, kept_peak)
