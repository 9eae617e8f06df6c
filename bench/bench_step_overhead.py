"""Per-step overhead of dsfunc.train_step against a plain PyTorch loop (same model, same AdamW).

    python bench/bench_step_overhead.py [--device cpu|cuda] [--steps 200] [--repeat 1]

Prints milliseconds per step for a tiny model (where the step is all overhead) and a small GPT, for
``train_step`` eager and, on CUDA, replayed as one CUDA graph (``compile.cuda_graph``). With ``--repeat N`` each
system is timed N times, the systems taking turns, and the medians are printed: a host shared with other work
moves a single timing by 20%.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import dsfunc
from dsfunc.models.gpt import GPT, GPTConfig, init_weights


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return F.cross_entropy(self.head(x), y)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def plain_step(model: nn.Module, device: torch.device):
    """The plain loop's step on a copy of ``model``: ``step(batch)``."""
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=device.type == "cuda")

    def step(batch) -> None:
        opt.zero_grad(set_to_none=True)
        model(*batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def plain(model: nn.Module, batch, steps: int, device: torch.device) -> float:
    step = plain_step(model, device)
    for i in range(steps + 10):
        if i == 10:
            sync(device)
            start = time.perf_counter()
        step(batch)
    sync(device)
    return (time.perf_counter() - start) / steps * 1e3


def functional(model: nn.Module, batch, steps: int, device: torch.device, graph: bool = False) -> float:
    config = {
        "train_micro_batch_size_per_gpu": batch[0].shape[0],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "compile": {"cuda_graph": graph},
    }
    state = dsfunc.init_state(model, config, device=device)
    for i in range(steps + 10):
        if i == 10:
            sync(device)
            start = time.perf_counter()
        state = dsfunc.train_step(state, batch)
    sync(device)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=1, help="timings of each system, taking turns; medians shown")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    tiny = Tiny()
    tiny_batch = (torch.randn(8, 32, device=device), torch.randint(0, 10, (8,), device=device))
    gpt = GPT(GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128))
    gpt.apply(init_weights)
    tokens = torch.randint(0, 256, (8, 65), device=device)
    gpt_batch = (tokens[:, :-1], tokens[:, 1:])
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps")
    graphs = device.type == "cuda"
    print("| model | params | plain PyTorch ms/step | dsfunc ms/step | dsfunc / plain |"
          + (" dsfunc, CUDA graph ms/step | graph / plain |" if graphs else ""))
    print("|---|---|---|---|---|" + ("---|---|" if graphs else ""))
    for name, model, batch in (("tiny MLP", tiny, tiny_batch), ("GPT 4x128", gpt, gpt_batch)):
        n = sum(p.numel() for p in model.parameters())
        job = (model, batch, args.steps, device)
        systems = [functools.partial(plain, *job), functools.partial(functional, *job)]
        if graphs:
            systems.append(functools.partial(functional, *job, graph=True))
        times = [[] for _ in systems]
        for _ in range(args.repeat):
            for run, got in zip(systems, times):
                got.append(run())
        a, b, *g = (statistics.median(t) for t in times)
        row = f"| {name} | {n:,} | {a:.3f} | {b:.3f} | {b / a:.2f} |"
        if graphs:
            row += f" {g[0]:.3f} | {g[0] / a:.2f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
