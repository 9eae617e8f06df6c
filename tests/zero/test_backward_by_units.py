"""The backward by units (``offload_optimizer.micro_batches_per_backward``): several micro-batches' joint backward
runs unit by unit, and trains bit for bit as each micro-batch's own backward does, with each unit's gradient sum
crossing to the host once a joint backward instead of once a micro-batch."""

from __future__ import annotations

import logging

import pytest
import torch

import dsfunc
from dsfunc.config import ConfigError
from dsfunc.errors import InputError
from dsfunc.models.gpt import GPT, GPTConfig
from dsfunc.zero.offload.grads import HostGrads
from tests.models import MLP, config, mlp_batches, relative_diff
from tests.multiprocess import run_world

VOCAB, SEQ = 64, 16


def gpt(*, tied: bool = False, dropout: float = 0.0, fused: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=3, n_head=2, d_model=16, dropout=dropout,
                          fused_loss=fused))
    if not tied:  # the root unit's parameters then each reach one segment: bit for bit (see the module's Note)
        model.head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    return model


def make_state(model: torch.nn.Module, per_backward: int, *, stage: int = 3, gas: int = 4, world: int = 1,
               policy: str = "units", bf16: bool = False, device_sums: int = 0,
               device: str = "cpu") -> dsfunc.TrainState:
    offload = {"device": "cpu", "micro_batches_per_backward": per_backward, "grad_accumulation_on_device": device_sums}
    cfg = config(micro=2, gas=gas, world=world, stage=stage, gradient_clipping=1.0,
                 activation_checkpointing={"policy": policy}, bf16={"enabled": bf16})
    cfg["optimizer"]["params"]["lr"] = 1e-2
    cfg["zero_optimization"].update(offload_optimizer=offload, stage3_param_persistence_threshold=0)
    return dsfunc.init_state(model, cfg, device=device)


def tokens(steps: int, rows: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (rows, SEQ), generator=gen), torch.randint(0, VOCAB, (rows, SEQ), generator=gen))
            for _ in range(steps)]


def train(state: dsfunc.TrainState, steps: int = 3, rank: int = 0, world: int = 1) -> dsfunc.TrainState:
    rows = 2 * state.program.config.gradient_accumulation_steps
    for idx, tgt in tokens(steps, rows * world):
        state = dsfunc.train_step(state, (idx[rank * rows:(rank + 1) * rows], tgt[rank * rows:(rank + 1) * rows]))
    return state


def outcome(state: dsfunc.TrainState) -> tuple[dict[str, torch.Tensor], float, float]:
    return dsfunc.full_params(state), float(state.metrics.loss), float(state.metrics.grad_norm)


@pytest.mark.parametrize("case", [
    {"stage": 3}, {"stage": 2}, {"stage": 3, "policy": "none"}, {"stage": 3, "bf16": True}, {"stage": 2, "gas": 5},
    {"stage": 3, "dropout": 0.1}, {"stage": 3, "fused": True}, {"stage": 3, "device_sums": 5000},
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_backward_by_units_trains_bit_for_bit_as_each_micro_batch_alone(case):
    """Groups of 2 (5 micro-batches: 2 + 2 + 1) and of 4; checkpointed units and not, fp32 and bf16, dropout,
    the fused head + loss, sums kept on the device."""
    model_kw = {k: case.pop(k) for k in ("dropout", "fused") if k in case}
    reference = outcome(train(make_state(gpt(**model_kw), 1, **case)))
    for per_backward in (2, 4):
        params, loss, norm = outcome(train(make_state(gpt(**model_kw), per_backward, **case)))
        assert relative_diff(params, reference[0]) == 0.0, per_backward
        assert (loss, norm) == reference[1:], per_backward


def test_a_unit_sum_crosses_to_the_host_once_a_joint_backward(monkeypatch):
    """Counted on the real host offload: with 4 micro-batches, each unit's sum goes out 4 times and comes back 3
    times; in one joint backward of 4 it goes out once (the root unit, both the embedding and the output projection,
    twice: its two parts are reached by the first and the last segment) and only the root's comes back."""
    counts = {"put": 0, "take": 0}
    for name in counts:
        real = getattr(HostGrads, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(HostGrads, name, counted)
    seen = {}
    for per_backward in (1, 4):
        counts.update(put=0, take=0)
        train(make_state(gpt(), per_backward), steps=1)
        seen[per_backward] = dict(counts)
    units = 4  # the root and three blocks
    assert seen[1] == {"put": 4 * units, "take": 3 * units}
    assert seen[4] == {"put": units + 1, "take": 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device_sums", [0, 5000])
def test_on_the_gpu_bit_for_bit_with_the_sums_on_copy_streams(device_sums):
    """On a GPU each sum goes out and comes back on copy streams of its own, beside backward: a sum must not be
    read or freed before its copies finish. Attention through the math kernel, whose backward is deterministic."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        reference = outcome(train(make_state(gpt(), 1, bf16=True, device_sums=device_sums, device="cuda:0")))
        params, loss, norm = outcome(train(make_state(gpt(), 4, bf16=True, device_sums=device_sums, device="cuda:0")))
    assert relative_diff(params, reference[0]) == 0.0 and (loss, norm) == reference[1:]


def test_a_tied_embedding_adds_its_two_parts_in_fp32():
    """GPT's token embedding is its output projection too: the head's part and the embedding's part of its gradient
    come from two segments and add in fp32, so one step differs from the usual order by rounding alone."""
    reference = outcome(train(make_state(gpt(tied=True), 1), steps=1))
    params, loss, norm = outcome(train(make_state(gpt(tied=True), 4), steps=1))
    assert loss == reference[1] and norm == pytest.approx(reference[2], rel=1e-6)
    assert relative_diff(params, reference[0]) < 1e-6
    assert all(torch.equal(params[k], reference[0][k]) for k in params if k.startswith("blocks."))


def test_a_skip_around_a_unit_is_refused_with_what_to_do():
    """tests.models.MLP adds each block's input to its output outside the block: that input reaches the loss
    around the unit, so its gradient would come from two segments."""
    cfg = config(micro=2, gas=4, stage=2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "micro_batches_per_backward": 4}
    state = dsfunc.init_state(MLP(), cfg)
    with pytest.raises(InputError, match="micro_batches_per_backward = 4: a tensor that a unit takes as input also "
                                         "reaches the loss another way .* Set micro_batches_per_backward to 1"):
        dsfunc.train_step(state, mlp_batches(1, 8)[0])


def test_the_config_key_is_checked_and_has_no_effect_at_stage_1(caplog):
    cfg = config(micro=2, gas=4, stage=2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "micro_batches_per_backward": 0}
    with pytest.raises(ConfigError, match="micro_batches_per_backward = 0 is invalid: expected an integer >= 1"):
        dsfunc.init_state(MLP(), cfg)
    cfg = config(micro=2, gas=4, stage=1)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "micro_batches_per_backward": 4}
    with caplog.at_level(logging.WARNING, logger="dsfunc"):
        state = dsfunc.init_state(MLP(), cfg)
    assert "micro_batches_per_backward has no effect at stage 1" in caplog.text
    assert state.program.run.grads.micro_batches_per_backward == 1


def test_a_hugging_face_llama_trains_bit_for_bit():
    """The decoder layers get the rotary embedding and the mask as further arguments, which need no gradient."""
    transformers = pytest.importorskip("transformers")

    def llama() -> torch.nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ))

    def run(per_backward: int) -> dict[str, torch.Tensor]:
        state = make_state(llama(), per_backward)
        for idx, _ in tokens(2, 8):
            state = dsfunc.train_step(state, {"input_ids": idx, "labels": idx})
        return dsfunc.full_params(state)

    assert relative_diff(run(4), run(1)) == 0.0


def ranks(rank: int, world: int) -> dict:
    out = {}
    for stage in (2, 3):
        for per_backward in (1, 4):
            state = train(make_state(gpt(), per_backward, stage=stage, world=world), steps=2, rank=rank, world=world)
            out[stage, per_backward] = (outcome(state), state.program.run.workspace.stats.gathers)
    return out


def test_on_two_ranks_bit_for_bit_and_a_stage_3_unit_gathered_once_for_the_joint_backward():
    for result in run_world(ranks, 2):
        for stage in (2, 3):
            (params, loss, norm), _ = result[stage, 4]
            (reference, ref_loss, ref_norm), _ = result[stage, 1]
            assert relative_diff(params, reference) == 0.0 and (loss, norm) == (ref_loss, ref_norm), stage
        # 3 blocks over 2 steps, each gathered for 4 forwards and 4 backwards, or 4 forwards and one backward
        assert (result[3, 1][1], result[3, 4][1]) == (3 * 2 * (4 + 4), 3 * 2 * (4 + 1))


def test_the_engine_says_the_key_has_no_effect_there(caplog):
    """Under the DeepSpeed engine the script runs each micro-batch's backward itself: nothing to run jointly."""
    cfg = config(micro=2, gas=2, stage=2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "micro_batches_per_backward": 2}
    with caplog.at_level(logging.WARNING, logger="dsfunc"):
        engine, *_ = dsfunc.initialize(model=MLP(), config=cfg)
    assert "micro_batches_per_backward has no effect under the engine" in caplog.text
    for x, y in mlp_batches(2, 2):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 1
