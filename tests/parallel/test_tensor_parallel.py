"""Tensor parallelism (torch's ColwiseParallel/RowwiseParallel from AutoTP's config surface) composed with ZeRO
trains a tiny Hugging Face Llama (GQA) like one process on the same global batch: losses within 1e-5
(relative) and every parameter within 1e-4 (norm-wise) after 8 clipped steps, with AdamW and with SGD with
momentum (not scale-invariant: a norm that counted a replicated parameter once per tp rank, or missed a split
one's other parts, would change the clip factor and every update), offloaded too, and with Lamb (whose trust
ratio needs each split parameter's whole norm)."""

from __future__ import annotations

import functools

import pytest
import torch

import dsfunc
from tests.multiprocess import run_world
from tests.parallel import tp_runs as runs


@functools.cache
def reference(optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, no tensor parallelism, the whole global batch."""
    return runs.train(runs.ds_config(runs.OPTIMIZERS[optimizer], 0, 1))


def assert_like_one_process(results: list, optimizer: str) -> None:
    losses, params = reference(optimizer)
    start = runs.llama().state_dict()
    moved = torch.stack([(params[k] - start[k]).norm() for k in params]).norm() / torch.stack(
        [start[k].norm() for k in params]).norm()
    assert moved > 3e-3, f"the reference barely trained ({moved:.2e}): the comparison could not see a wrong factor"
    for rank_losses, rank_params in results:
        assert rank_params.keys() == params.keys()
        for got, want in zip(rank_losses, losses):
            assert abs(got - want) <= 1e-5 * abs(want), (rank_losses, losses)
        for name, want in params.items():
            assert rank_params[name].shape == want.shape, name
            assert (rank_params[name] - want).norm() <= 1e-4 * want.norm(), name


@pytest.mark.parametrize(
    ("optimizer", "stage", "dp", "offload", "tensor", "mesh_dims"),
    [
        ("AdamW", 1, 1, False, {}, None),  # the model's own tp plan (base_model_tp_plan + lm_head, embed_tokens)
        ("AdamW", 2, 2, False, {"preset_model": "llama"}, None),
        ("SGD", 1, 2, False, {"partition_config": {"layer_specs": [
            {"patterns": [r".*\.(o_proj|down_proj)\.weight$"], "partition_type": "row"},
            {"patterns": [r".*\.([qkv]_proj|gate_proj|up_proj)\.weight$"], "partition_type": "column"}]}},
         ("dp", "tp")),
        ("SGD", 3, 2, False, {}, None),
        ("SGD", 2, 2, True, {}, None),  # ZeRO-Offload: the host update clips by the same tp-aware norm
        ("Lamb", 1, 2, False, {}, None),  # trust ratios of whole parameters: norms over dp, then over tp
    ],
    ids=["tp2-hf-plan-zero1", "tp2xdp2-preset-zero2", "tp2xdp2-specs-sgd-zero1-given-mesh", "tp2xdp2-sgd-zero3",
         "tp2xdp2-sgd-zero2-offload", "tp2xdp2-lamb-zero1"],
)
def test_tensor_parallel_trains_like_one_process(optimizer, stage, dp, offload, tensor, mesh_dims):
    config = runs.ds_config(runs.OPTIMIZERS[optimizer], stage, dp, tp=2, offload=offload, **tensor)
    results = run_world(runs.train_rank, 2 * dp, config, mesh_dims, timeout=900)
    assert_like_one_process(results, optimizer)


def test_explicit_tp_plan_trains_like_one_process():
    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
    results = run_world(runs.train_rank, 2, runs.ds_config(runs.SGD, 2, 1, tp=2), None, plan, timeout=900)
    assert_like_one_process(results, "SGD")


def test_deepspeed_engine_with_autotp_trains_like_one_process():
    results = run_world(runs.engine_rank, 2, runs.ds_config(runs.SGD, 1, 1, tp=2), timeout=900)
    assert_like_one_process(results, "SGD")


def test_errors_name_what_does_not_split():
    heads, no_plan = run_world(runs.errors, 2, timeout=900)[0]
    assert "num_key_value_heads (1) is not divisible by the 2 tensor-parallel ranks" in heads
    assert "found nothing to split in Sequential" in no_plan and "linear modules are ['0', '1']" in no_plan


def test_world_the_mesh_does_not_divide():
    with pytest.raises(dsfunc.InputError, match="world size 1 is not divisible by the mesh's tp 2"):
        dsfunc.init_state(runs.llama(), runs.ds_config(runs.ADAMW, 1, 1, tp=2))
