"""Activation checkpointing of units: the same parameters as without it, at every stage, with less saved."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from tests.models import relative_diff
from tests.multiprocess import run_world

STEPS = 6


def gpt(n_layer: int = 4) -> torch.nn.Module:
    from dsfunc.models.gpt import GPT, GPTConfig, init_weights

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=n_layer, n_head=2, d_model=32, dropout=0.1))
    model.apply(init_weights)
    return model


def config(stage: int, remat: dict | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if remat is not None:
        cfg["activation_checkpointing"] = remat
    return cfg


def batches(rank: int, world: int, steps: int = STEPS) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        t = torch.randint(0, 64, (4 * world, 17), generator=g)[4 * rank : 4 * (rank + 1)]
        out.append((t[:, :-1], t[:, 1:]))
    return out


POLICIES = [None, {"policy": "units"}, {"policy": "units", "every": 2}, {"policy": "selective"},
            {"policy": "units", "cpu_checkpointing": True}]


def train_policies(rank: int, world: int, stages: list[int], policies: list[int]) -> dict:
    out = {}
    for stage in stages:
        for i in [0, *policies]:
            remat = POLICIES[i]
            state = dsfunc.init_state(gpt(), config(stage, remat), seed=4)
            for batch in batches(rank, world):
                state = dsfunc.train_step(state, batch)
            out[stage, i] = (dsfunc.full_params(state), state.metrics.loss.item())
    return out


@pytest.mark.parametrize("world, stages, policies", [(1, [0, 3], [1, 2, 3, 4]), (2, [0, 1, 2, 3], [1, 3]),
                                                    (4, [3], [2])])
def test_every_policy_trains_bit_for_bit_like_no_checkpointing(world, stages, policies):
    for per_rank in run_world(train_policies, world, stages, policies):
        for stage in stages:
            reference, loss = per_rank[stage, 0]
            for i in policies:
                params, other = per_rank[stage, i]
                assert other == loss and relative_diff(params, reference) == 0.0, (world, stage, POLICIES[i])


def saved_bytes(policy: str | None) -> int:
    """Bytes autograd keeps for backward during one training forward (what checkpointing saves)."""
    state = dsfunc.init_state(gpt(n_layer=4), config(0), activation_checkpointing=policy)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    x, y = batches(0, 1, 1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dsfunc.train_step(state, (x, y))
    return total


def test_checkpointing_saves_less(monkeypatch):
    from dsfunc import remat

    decisions = []

    def spy(ctx, op, *args, **kwargs):
        decision = real(ctx, op, *args, **kwargs)
        decisions.append((op, decision))
        return decision

    real = remat._policy
    monkeypatch.setattr(remat, "_policy", spy)
    none, selective, units = saved_bytes(None), saved_bytes("selective"), saved_bytes("units")
    # autograd keeps only each checkpointed unit's inputs; the selective policy's saved matmul outputs
    # live in the checkpoint's own cache (not seen by saved-tensor hooks): check its decisions instead
    assert units < none / 4 and selective == units, (none, selective, units)
    saved = {op for op, d in decisions if d == remat.CheckpointPolicy.MUST_SAVE}
    recomputed = {op for op, d in decisions if d == remat.CheckpointPolicy.PREFER_RECOMPUTE}
    assert torch.ops.aten.addmm.default in saved or torch.ops.aten.mm.default in saved, saved
    assert recomputed and not (saved & recomputed)


def test_resume_across_a_save_stays_bitwise(tmp_path):
    cfg = config(2, {"policy": "units"})
    data = batches(0, 1, 8)
    whole = dsfunc.init_state(gpt(), cfg, seed=9)
    for batch in data:
        whole = dsfunc.train_step(whole, batch)
    first = dsfunc.init_state(gpt(), cfg, seed=9)
    for batch in data[:4]:
        first = dsfunc.train_step(first, batch)
    dsfunc.save_checkpoint(first, tmp_path)
    resumed, _ = dsfunc.load_checkpoint(tmp_path, dsfunc.init_state(gpt(), cfg, seed=9))
    for batch in data[4:]:
        resumed = dsfunc.train_step(resumed, batch)
    assert relative_diff(dsfunc.full_params(resumed), dsfunc.full_params(whole)) == 0.0


def test_keys_that_cannot_apply_are_errors():
    with pytest.raises(dsfunc.ConfigError, match="partition_activations = true: .*model-parallel"):
        dsfunc.init_state(gpt(), config(0, {"partition_activations": True}))
    with pytest.raises(dsfunc.ConfigError, match=r'policy = "all" is invalid: expected one of "none", "units"'):
        dsfunc.init_state(gpt(), config(0), activation_checkpointing="all")


def hf_train(rank: int, world: int, stages: list[int]) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    out = {}
    for stage in stages:
        results = []
        for checkpointed in (False, True):
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
            if checkpointed:
                model.gradient_checkpointing_enable()
            state = dsfunc.init_state(model, config(stage), loss_fn=lambda m, b: m(input_ids=b[0], labels=b[0]).loss)
            for batch in batches(rank, world, 3):
                state = dsfunc.train_step(state, batch)
            results.append(dsfunc.full_params(state))
        out[stage] = relative_diff(results[1], results[0])
    return out


def test_a_hugging_face_models_own_gradient_checkpointing_works_at_every_stage():
    pytest.importorskip("transformers")
    for per_rank in run_world(hf_train, 2, [0, 1, 2, 3]):
        assert all(diff < 1e-6 for diff in per_rank.values()), per_rank


def test_deepspeeds_checkpointing_api_checkpoints_a_call():
    from dsfunc.runtime.activation_checkpointing import checkpointing

    import dsfunc as deepspeed

    assert deepspeed.checkpointing is checkpointing  # both of DeepSpeed's paths

    checkpointing.reset()
    assert not checkpointing.is_configured()
    checkpointing.configure(None, deepspeed_config={"train_batch_size": 1,
                                                  "activation_checkpointing": {"profile": True}},
                            synchronize=True)
    assert checkpointing.is_configured()
    layer = torch.nn.Linear(4, 4)
    for cpu in (False, True):
        checkpointing.configure(None, checkpoint_in_cpu=cpu)
        x = torch.randn(3, 4, requires_grad=True, generator=torch.Generator().manual_seed(0))
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=saved: kept.append(t) or t, lambda t: t):
            y = checkpointing.checkpoint(lambda v: torch.tanh(layer(v)), x)
        y.sum().backward()
        expected = torch.autograd.grad(torch.tanh(layer(x)).sum(), x)[0]
        assert torch.allclose(x.grad, expected)
        # only the input was kept, tanh and the matmul recompute (with cpu_checkpointing the host keeps it)
        assert len(saved) == (0 if cpu else 1)
    with pytest.raises(dsfunc.ConfigError, match="partition_activations"):
        checkpointing.configure(None, partition_activations=True)
    checkpointing.reset()


def test_a_module_trained_in_place_again_is_checkpointed_once():
    """A second state over the same module (the engine's in_place) replaces the first one's checkpointing: the
    forwards are not wrapped twice, and a state without checkpointing leaves them as they were."""
    model = gpt()
    block = model.blocks[0]
    own = block.forward
    for _ in range(2):
        dsfunc.init_state(model, config(0), activation_checkpointing="units", in_place=True)
        assert block.forward.func is dsfunc.remat.checkpoint and block.forward.args == (own,)
    dsfunc.init_state(model, config(0), in_place=True)
    assert block.forward == own and "forward" not in block.__dict__
