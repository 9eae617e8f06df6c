"""The model, data and per-rank runs the pipeline tests share: a tied-embedding language model as a layer
list, trained pipelined on the ranks of a test world and, for reference, in one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dsfunc
from dsfunc.errors import InputError, NotSupportedError
from dsfunc.pipeline import LayerSpec, StageModule, TiedLayerSpec

VOCAB, DIM, SEQ, MICRO, GAS, STEPS = 16, 8, 5, 2, 4, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


def head(embedding: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))


def layers() -> list[Any]:
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), LayerSpec(Block), LayerSpec(Block),
            LayerSpec(Block), TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=head)]


def config(zero: int = 0, clip: float = 0.5, bf16: bool = False, micro: int = MICRO, **extra: Any) -> dict[str, Any]:
    """The run's config; ``extra`` adds or replaces sections."""
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
            "gradient_clipping": clip, "bf16": {"enabled": bf16}, "zero_optimization": {"stage": zero},
            "steps_per_print": None, **extra}


def batches(replicas: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, each replica's ``(tokens, labels)`` of MICRO x GAS samples."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (replicas * MICRO * GAS, SEQ), generator=g)
        labels = torch.roll(tokens, -1, dims=1)
        n = MICRO * GAS
        out.append([(tokens[r * n:(r + 1) * n], labels[r * n:(r + 1) * n]) for r in range(replicas)])
    return out


def train_pipelined(cfg: dict[str, Any], pipeline: dict[str, Any] | None, replicas: int, replica: int) -> dict[str, Any]:
    state = dsfunc.init_state(layers(), cfg, loss_fn=loss_fn, pipeline=pipeline)
    init = dsfunc.full_params(state)
    losses = []
    for step in batches(replicas):
        state = dsfunc.train_step(state, step[replica])
        losses.append(float(state.metrics.loss))
    return {"init": init, "losses": losses, "final": dsfunc.full_params(state), "state": state}


def train_reference(init: dict[str, torch.Tensor], cfg: dict[str, Any], replicas: int) -> dict[str, Any]:
    """One process, the whole model, each step's global batch (micro-batch i of every replica joined)."""
    model = StageModule(layers(), partition_method="uniform")
    model.load_state_dict(init)
    state = dsfunc.init_state(model, cfg, loss_fn=lambda m, b: loss_fn(m(b[0]), b[1]))
    losses = []
    for step in batches(replicas):
        micro = [[(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]) for x, y in step] for i in range(GAS)]
        joined = [(torch.cat([x for x, _ in m]), torch.cat([y for _, y in m])) for m in micro]
        state = dsfunc.train_step(state, joined)
        losses.append(float(state.metrics.loss))
    return {"losses": losses, "final": dsfunc.full_params(state)}


PIPE = {"stages": 2, "partition_method": "uniform"}


def one_replica_steps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [step[0] for step in batches(1)]


def as_replicas(step: tuple[torch.Tensor, torch.Tensor], replicas: int, replica: int, micro: int) -> Any:
    """The same global batch for ``replicas`` replicas of ``micro`` samples per micro-batch: replica r takes
    the r-th part of every micro-batch of the one-replica batch."""
    x, y = step
    parts = [(x[i * MICRO:(i + 1) * MICRO][replica * micro:(replica + 1) * micro],
              y[i * MICRO:(i + 1) * MICRO][replica * micro:(replica + 1) * micro]) for i in range(GAS)]
    return parts


def save_half_way(folder: str) -> dict[str, Any]:
    """pp 2, one replica: 2 steps, a checkpoint, 2 more steps."""
    state = dsfunc.init_state(layers(), config(), loss_fn=loss_fn, pipeline=PIPE)
    steps = one_replica_steps()
    for step in steps[:2]:
        state = dsfunc.train_step(state, step)
    dsfunc.save_checkpoint(state, folder, tag="half")
    saved = dsfunc.full_params(state)
    losses = []
    for step in steps[2:]:
        state = dsfunc.train_step(state, step)
        losses.append(float(state.metrics.loss))
    return {"saved": saved, "losses": losses}


def resume(state: Any, folder: str, replicas: int, replica: int) -> list[float]:
    """Load ``folder``'s checkpoint into ``state`` and run the last 2 steps on ``replicas`` replicas."""
    state, _ = dsfunc.load_checkpoint(folder, state, tag="half")
    losses = []
    for step in one_replica_steps()[2:]:
        state = dsfunc.train_step(state, as_replicas(step, replicas, replica, MICRO // replicas))
        losses.append(float(state.metrics.loss))
    return losses


def two_stages(rank: int, world: int, folder: str) -> dict[str, Any]:
    """pp 2 on 2 ranks: 1F1B with clipping, GPipe from the config section, activation checkpointing, bf16,
    a batch of the wrong size, a stage refused the whole-model compile scope, and a checkpoint half way."""
    out = {
        "ckpt": save_half_way(folder),
        "1f1b": train_pipelined(config(), PIPE, 1, 0),
        "gpipe": train_pipelined(config(pipeline={**PIPE, "schedule": "GPipe"}), None, 1, 0),
        "remat": train_pipelined(config(), {**PIPE, "activation_checkpoint_interval": 1}, 1, 0),
        "bf16": train_pipelined(config(bf16=True), PIPE, 1, 0),
        "fp16": train_pipelined(config(fp16={"enabled": True, "initial_scale_power": 8}), PIPE, 1, 0),
    }
    state = out["1f1b"].pop("state")
    tokens, labels = batches(1)[0][0]
    try:
        dsfunc.train_step(state, (tokens[:6], labels[:6]))
    except InputError as e:
        out["bad_batch"] = str(e)
    try:
        dsfunc.init_state(layers(), config(compile={"enabled": True, "scope": "model"}), loss_fn=loss_fn, pipeline=PIPE)
    except NotSupportedError as e:
        out["whole_model_compile"] = str(e)
    for case in out.values():
        if isinstance(case, dict):
            case.pop("state", None)
    return out


def two_by_two(rank: int, world: int, folder: str) -> dict[str, Any]:
    """pp 2 x dp 2 on 4 ranks at ZeRO 1, 2 and 3; the 2-rank checkpoint resumed here at ZeRO 3 (the same
    global batch over 2 replicas), and a 4-stage one-replica run of the same checkpoint."""
    out: dict[str, Any] = {}
    for zero in (1, 2, 3):
        run = train_pipelined(config(zero=zero), PIPE, 2, rank % 2)
        run.pop("state")
        out[zero] = run
    template = dsfunc.init_state(layers(), config(zero=3, micro=MICRO // 2), loss_fn=loss_fn, pipeline=PIPE)
    out["resumed"] = resume(template, folder, 2, rank % 2)
    four = dsfunc.init_state(layers(), config(zero=1), loss_fn=loss_fn, pipeline={**PIPE, "stages": 4})
    out["four_stages"] = resume(four, folder, 1, 0)
    return out


def interleaved(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Interleaved 1F1B: 4 stages on 2 ranks (each rank two of them), and its checkpoint in ``folder``."""
    pipeline = {"stages": 4, "stages_per_rank": 2, "schedule": "Interleaved1F1B", "partition_method": "uniform"}
    run = train_pipelined(config(), pipeline, 1, 0)
    state = run.pop("state")
    run["held"] = state.program.skeleton.held_stages
    dsfunc.save_checkpoint(state, folder, tag="end")
    return run
