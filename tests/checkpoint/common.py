"""What the one-process checkpoint tests share: configs, a model with every kind of tensor, helpers."""

from __future__ import annotations

import optree
import torch
import torch.nn.functional as F
from torch import nn

import dsfunc

FP16 = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2, "hysteresis": 2}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 6}}


class Tied(nn.Module):
    """Tied embedding and head, BatchNorm buffers, a frozen parameter, blocks in a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.norm = nn.BatchNorm1d(6)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6), requires_grad=False)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(x).mean(1)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(self.norm(h) * self.scale)
        return logits if y is None else F.cross_entropy(logits.float(), y)


def tied_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 11, (4, 3), generator=g), torch.randint(0, 11, (4,), generator=g))
            for _ in range(steps)]


def leaves_equal(a: dsfunc.TrainState, b: dsfunc.TrainState) -> bool:
    xs, ys = optree.tree_leaves(a), optree.tree_leaves(b)
    return len(xs) == len(ys) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(xs, ys))


def trained(model: nn.Module, cfg: dict, batches: list, steps: int, seed: int = 0) -> dsfunc.TrainState:
    state = dsfunc.init_state(model, cfg, seed=seed)
    for i in range(steps):
        state = dsfunc.train_step(state, batches[i])
    return state
