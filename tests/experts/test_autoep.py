"""AutoEP in one process: the ``expert_parallel`` section as DeepSpeed names it, the errors for a model or size it
cannot split, the grouped matmul against one matmul per expert, and a replaced block computing what the Hugging
Face block computes (outputs, router logits and load-balancing loss; training with each router option)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import dsfunc
from dsfunc.config import ConfigError
from dsfunc.config.expert_parallel import ExpertParallelConfig, parse_expert_parallel
from dsfunc.errors import InputError
from dsfunc.experts.autoep import apply_autoep
from dsfunc.experts.ep_block import ExpertParallelBlock
from dsfunc.experts.grouped import grouped_mm
from dsfunc.experts.shared import SharedExpertParallelBlock
from tests.experts import hf_moe


def test_section_reads_deepspeeds_keys_and_defaults():
    assert parse_expert_parallel(None) == ExpertParallelConfig(enabled=False, autoep_size=1, preset_model=None,
                                                               use_grouped_mm=True)
    given = parse_expert_parallel({"enabled": True, "autoep_size": 2, "preset_model": "mixtral", "top_k": "auto",
                                   "load_balance_coeff": None, "combine_impl": "weighted_sum"})
    assert (given.enabled, given.autoep_size, given.preset_model) == (True, 2, "mixtral")
    assert dsfunc.Config.load({"train_batch_size": 2, "expert_parallel": {"enabled": True}}).expert_parallel.enabled


@pytest.mark.parametrize(("section", "message"), [
    ({"preset_model": "minimax_m3"}, "DeepSpeed's 'minimax_m3' preset is not implemented by dsfunc"),
    ({"preset_model": "llama"}, 'one of "qwen3_moe", "mixtral"'),
    ({"top_k": 3}, "top_k"),
    ({"load_balance_coeff": 0.1}, "load_balance_coeff"),
    ({"autoep_size": 0}, "autoep_size"),
    ({"autoep_sise": 2}, "autoep_size"),
])
def test_section_errors_name_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        parse_expert_parallel(section)


def test_errors_name_what_cannot_be_split():
    on = ExpertParallelConfig(enabled=True)
    with pytest.raises(InputError, match=r"num_experts=4 of the qwen3_moe block model.layers.0.mlp is not divisible "
                                         r"by expert_parallel.autoep_size=3.*among \[1, 2, 4\]"):
        apply_autoep(hf_moe.build("qwen3_moe"), ExpertParallelConfig(enabled=True, autoep_size=3))
    with pytest.raises(InputError, match="autoep_size=2 does not divide the world size 1"):
        apply_autoep(hf_moe.build("mixtral"), ExpertParallelConfig(enabled=True, autoep_size=2))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(InputError, match="model_type='llama'.*no model family AutoEP knows.*no module named like MoE"):
        apply_autoep(llama, on)
    with pytest.raises(InputError, match=r"the 'qwen3_moe' preset replaces Qwen3MoeSparseMoeBlock modules, and "
                                         r"MixtralForCausalLM has none \(its modules that look like MoE: "
                                         r"model.layers.0.mlp \(MixtralSparseMoeBlock\)"):
        apply_autoep(hf_moe.build("mixtral"), ExpertParallelConfig(enabled=True, preset_model="qwen3_moe"))


@pytest.mark.parametrize("width", [32, 6])  # 6: rows torch._grouped_mm does not take, one matmul per expert
def test_grouped_matmul_is_a_matmul_per_expert(width):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(7, width, generator=gen, requires_grad=True)
    weights = torch.randn(3, width, 8, generator=gen, requires_grad=True)
    offsets = torch.tensor([3, 3, 7], dtype=torch.int32)  # the middle expert gets no rows
    seed = torch.randn(7, 8, generator=gen)
    grads = []
    for fused in (True, False):
        tokens.grad = weights.grad = None
        out = grouped_mm(tokens, weights, offsets, fused=fused)
        (out * seed).sum().backward()
        grads.append((out.detach(), tokens.grad, weights.grad))
    expected = torch.cat([tokens[:3] @ weights[0], tokens[3:] @ weights[2]])
    torch.testing.assert_close(grads[0][0], expected.detach())
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert grads[0][2][1].abs().sum() == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replaced_block_computes_the_hf_blocks_outputs_and_router_loss(family):
    model = hf_moe.build(family)
    replaced = copy.deepcopy(model)
    assert apply_autoep(replaced, ExpertParallelConfig(enabled=True)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    block = replaced.model.layers[1].mlp
    assert isinstance(block, ExpertParallelBlock)
    assert apply_autoep(replaced, ExpertParallelConfig(enabled=True)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert replaced.model.layers[1].mlp is block  # a replaced block is kept as it is
    assert {n: p.shape for n, p in replaced.named_parameters()} == {n: p.shape for n, p in model.named_parameters()}
    ids = hf_moe.batch(0, 4)
    ours, theirs = replaced(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    assert len(ours.router_logits) == 2 and ours.aux_loss > 0
    for a, b in [(ours.loss, theirs.loss), (ours.aux_loss, theirs.aux_loss), (ours.logits, theirs.logits),
                 *zip(ours.router_logits, theirs.router_logits)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grouped", [True, False])
def test_one_process_training_equals_hf_without_topk_renormalisation(grouped):
    model = hf_moe.build("qwen3_moe", norm_topk_prob=False)
    config = hf_moe.config(1, "sgd", expert_parallel={"enabled": True, "use_grouped_mm": grouped})
    state = dsfunc.init_state(model, config)
    losses = []
    for step in range(3):
        ids = hf_moe.batch(step, hf_moe.MICRO)
        state = dsfunc.train_step(state, {"input_ids": ids, "labels": ids})
        losses.append(float(state.metrics.loss))
    expected, params = hf_moe.reference("qwen3_moe", 1, "sgd", 3, norm_topk_prob=False)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, expected)), (losses, expected)
    full = dsfunc.full_params(state)
    assert all(hf_moe.relative(full[name], value) <= 1e-5 for name, value in params.items())
    assert model.model.layers[0].mlp.experts.fused is grouped


def test_initialize_with_the_models_parameters_trains_the_replaced_experts():
    model = hf_moe.build("mixtral")
    config = hf_moe.config(1, "sgd", expert_parallel={"enabled": True})
    engine, *_ = dsfunc.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert isinstance(engine.module.model.layers[0].mlp, ExpertParallelBlock)
    losses = []
    for step in range(3):
        ids = hf_moe.batch(step, hf_moe.MICRO)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    expected, params = hf_moe.reference("mixtral", 1, "sgd", 3)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, expected)), (losses, expected)
    full = dsfunc.full_params(engine.state)
    assert all(hf_moe.relative(full[name], value) <= 1e-5 for name, value in params.items())


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_blocks_keep_shared_experts_and_group_limited_routing_and_train_as_hf(family):
    """DeepSeek's presets: the shared expert kept beside the routed ones, the router's group-limited top-k (which
    the tiny config makes differ from a plain top-k) deciding, outputs and one-process training equal to HF's."""
    model = hf_moe.build(family)
    replaced = copy.deepcopy(model)
    layers = (0, 1) if family == "deepseek_v2" else (1, 2)  # V3's first layer is dense
    assert apply_autoep(replaced, ExpertParallelConfig(enabled=True)) == [f"model.layers.{i}.mlp" for i in layers]
    block = replaced.model.layers[layers[0]].mlp
    assert isinstance(block, SharedExpertParallelBlock)
    assert [n for n, _ in block.named_parameters()] == [
        "gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_experts.gate_proj.weight",
        "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"]
    tokens = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    picked = block.gate(tokens)[2].sort(1).values
    assert (picked != torch.topk(tokens @ block.gate.weight.t(), 2).indices.sort(1).values).any()
    ids = hf_moe.batch(0, 4)
    ours, theirs = replaced(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-6)
    state = dsfunc.init_state(hf_moe.build(family), hf_moe.config(1, "sgd", expert_parallel={"enabled": True}))
    losses = []
    for step in range(3):
        ids = hf_moe.batch(step, hf_moe.MICRO)
        state = dsfunc.train_step(state, {"input_ids": ids, "labels": ids})
        losses.append(float(state.metrics.loss))
    expected, params = hf_moe.reference(family, 1, "sgd", 3)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, expected)), (losses, expected)
    full = dsfunc.full_params(state)
    assert all(hf_moe.relative(full[n], v) <= 1e-5 for n, v in params.items())  # (full: V3's router bias too)
