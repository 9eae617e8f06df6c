"""Tiny models and data shared by the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Blocks in a ModuleList (so ZeRO finds units), a root layer, and a loss from forward."""

    def __init__(self, width: int = 8, depth: int = 3, classes: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(dropout)) for _ in range(depth)
        )
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        logits = self.out(h)
        return logits if y is None else F.cross_entropy(logits.float(), y)


class ConvBN(nn.Module):
    """A BatchNorm model: its running statistics are buffers the step must return updated."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return F.cross_entropy(self.fc(h).float(), y)


def mlp_batches(steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


def config(micro: int = 4, gas: int = 1, world: int = 1, stage: int = 0, **extra: object) -> dict:
    cfg = {
        "train_batch_size": micro * gas * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
    }
    cfg.update(extra)
    return cfg


# SGD with momentum is not scale-invariant (Adam nearly is): a gradient a constant factor off moves the parameters by
# that factor. CLIP sits inside the range of the MLP's gradient norms on mlp_batches (about 0.6-4 at global batches
# 2-16), so some steps clip and others do not: a wrong factor in the gradient or in its norm changes which do.
SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}}
CLIP = 2.0


def torch_sgd(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], clip: float = CLIP) -> dict:
    """``SGD`` by torch.optim on one process, clipped by ``clip_grad_norm_``, one step per global batch in
    ``batches``: what a run of dsfunc over any ranks, stage and accumulation must give. Returns the state dict."""
    params = SGD["params"]
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=params["momentum"],
                          weight_decay=params["weight_decay"])
    for x, y in batches:
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def relative_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    a, b = ({k: v.detach().cpu() for k, v in d.items()} for d in (a, b))
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in a)
