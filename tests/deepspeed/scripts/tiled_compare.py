"""ALST's tiled compute through DeepSpeed's names, under whichever ``deepspeed`` imports (the real one, or dsfunc
with DSFUNC_AS_DEEPSPEED=1): outputs and gradients of a tiled MLP, a tiled logits loss and a sequence-tiled
loss, saved to ``argv[1]`` for tests/deepspeed/test_tiled_against_deepspeed.py to compare."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = torch.nn.Linear(8, 24), torch.nn.Linear(8, 24), torch.nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def grads(*tensors: torch.Tensor) -> list[torch.Tensor]:
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


def main(out: str) -> None:
    torch.manual_seed(0)
    mlp, head = MLP(), torch.nn.Linear(8, 13)
    x = torch.randn(2, 10, 8, requires_grad=True)
    labels = torch.randint(0, 13, (2, 10))
    mask = torch.rand(2, 10) > 0.3
    results = {}

    y = TiledMLP.apply(lambda m, h: m(h), mlp, x, 3, list(mlp.parameters()))
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    results["mlp"] = [y.detach(), *grads(x, *mlp.parameters())]

    def logits_loss(module, h, t, m):
        per_token = F.cross_entropy(module(h).float(), t, reduction="none")
        return (per_token * m).sum() / m.sum().clamp_min(1)

    for reduction in ("mean", "sum"):
        loss = TiledFusedLogitsLoss.apply(logits_loss, head, x, labels, mask, 3, [head.weight, head.bias], reduction)
        loss.backward()  # DeepSpeed scales only x's gradient by an incoming gradient other than 1
        results[f"logits_{reduction}"] = [loss.detach(), *grads(x, head.weight, head.bias)]

    def seq_loss(hidden_states, labels):
        return F.cross_entropy(head(hidden_states).flatten(0, 1), labels.flatten())

    loss = sequence_tiled_compute(seq_loss, 10, 4, {"hidden_states": x, "labels": labels}, {}, "hidden_states",
                                  [head.weight, head.bias], output_unshard_dimension=0, output_reduction="mean")
    loss.backward()
    results["sequence"] = [loss.detach(), *grads(x, head.weight, head.bias)]
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
