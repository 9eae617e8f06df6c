"""Training runs of a tiny Hugging Face Llama (GQA) for the tensor-parallel tests: one process on the global
batch (the reference), or a rank of a tp x dp mesh on its data-parallel slice of it."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch.distributed.device_mesh import init_device_mesh

import dsfunc
import dsfunc.parallel

GLOBAL_BATCH, SEQ, VOCAB, STEPS = 8, 12, 64, 8
ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
SGD = {"type": "SGD", "params": {"lr": 4.0, "momentum": 0.9}}
LAMB = {"type": "Lamb", "params": {"lr": 2e-2, "weight_decay": 0.01}}
OPTIMIZERS = {"AdamW": ADAMW, "SGD": SGD, "Lamb": LAMB}


def llama(heads: int = 4, kv_heads: int = 2) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=SEQ, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def ds_config(optimizer: dict[str, Any], stage: int, dp: int, tp: int = 1, offload: bool = False,
              **tensor: Any) -> dict[str, Any]:
    """Two micro-batches per step, clipped at 0.05 (below the gradients' norm, so the clip scales every step);
    ``offload``: the optimizer's update on the host (ZeRO-Offload)."""
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 2, "optimizer": optimizer,
              "gradient_clipping": 0.05, "zero_optimization": zero, "steps_per_print": None}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp, **tensor}
    return config


def batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def train(config: dict[str, Any], **init: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """8 steps on this rank's data-parallel slice of each global batch: the losses, and the full parameters."""
    state = dsfunc.init_state(llama(), config, **init)
    train_step = dsfunc.train_step
    if "mesh" in init:  # the composed step, its shard() naming the mesh the state was built on
        train_step = dsfunc.make_train_step(dsfunc.scale_loss()(dsfunc.shard(mesh=init["mesh"])(dsfunc.accumulate()(
            dsfunc.value_and_grad()))))
    mesh = state.program.mesh
    dp, rank = mesh.size("dp"), mesh.group("dp").rank
    losses = []
    for step in range(STEPS):
        mine = {k: v.chunk(dp)[rank] for k, v in batch(step).items()}
        state = train_step(state, mine)
        losses.append(float(state.metrics.loss))
    if mesh.size("tp") > 1:
        where = dsfunc.parallel.placements(state)
        assert where["model.layers.0.self_attn.k_proj.weight"]["tp"] == "Shard(dim=0)", where
        assert where["model.norm.weight"]["tp"] == "Replicate()", where
    return losses, dsfunc.full_params(state)


def train_rank(rank: int, world_size: int, config: dict[str, Any], mesh_dims: tuple[str, ...] | None = None,
               tp_plan: dict[str, str] | None = None) -> Any:
    """:func:`train` on a spawned rank; ``mesh_dims``: on a torch DeviceMesh of these dimensions (2 ranks each)
    given to init_state instead of the one the config describes."""
    init: dict[str, Any] = {"tp_plan": tp_plan} if tp_plan is not None else {}
    if mesh_dims is not None:
        init["mesh"] = init_device_mesh("cpu", (2,) * len(mesh_dims), mesh_dim_names=mesh_dims)
    return train(config, **init)


def errors(rank: int, world_size: int) -> list[str]:
    """What init_state says, on 2 ranks at tp 2, to a model whose KV heads do not split and to one no plan fits."""
    out = []
    for model in (llama(heads=4, kv_heads=1), torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))):
        try:
            dsfunc.init_state(model, ds_config(ADAMW, 1, 1, tp=2), loss_fn=lambda m, b: m(b).sum())
        except dsfunc.InputError as e:
            out.append(str(e))
    torch.distributed.barrier()  # a rank outside a 1-rank group of the mesh does not wait for its making
    return out


def engine_rank(rank: int, world_size: int, config: dict[str, Any]) -> Any:
    """:func:`train` through the DeepSpeed engine (the model trained in place): forward, backward, step per
    micro-batch."""
    engine, *_ = dsfunc.initialize(model=llama(), config=config)
    mesh = engine.state.program.mesh
    dp, rank = mesh.size("dp"), mesh.group("dp").rank
    losses = []
    for step in range(STEPS):
        mine = {k: v.chunk(dp)[rank] for k, v in batch(step).items()}
        for micro in range(config["gradient_accumulation_steps"]):
            engine.backward(engine(**{k: v.chunk(2)[micro] for k, v in mine.items()}).loss)
            engine.step()
        losses.append(float(engine.state.metrics.loss))
    return losses, dsfunc.full_params(engine.state)
