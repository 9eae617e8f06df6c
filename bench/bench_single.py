"""The BENCH.md workload on one GPU: plain PyTorch against dsfunc, eager, compiled and checkpointed, in one run.

    python bench/bench_single.py --model 1.3b --systems plain,plain+compile,dsfunc,dsfunc+compile

A system is a name and options joined by ``+``:

* ``plain``: the model in bf16 autocast returning its loss (``model(x, y)``: the fp32 cross-entropy over the
  logits, nanoGPT's), fused AdamW, clip 1.0 (BENCH.md's "plain PyTorch"); ``+compile`` wraps the whole model,
  loss inside, in ``torch.compile`` (the strong baseline); ``+ckpt`` puts ``torch.utils.checkpoint`` around
  every block.
* ``dsfunc``: ``dsfunc.train_step`` at ZeRO stage 0 (``+zero3`` for stage 3), bf16, the same AdamW;
  ``+compile`` compiles each block (``compile.enabled``), ``+whole`` the whole model's forward, loss inside,
  as one graph (``compile.scope = "model"``), ``+graph`` replays the whole step as a CUDA graph
  (``compile.cuda_graph``), ``+units`` / ``+selective`` checkpoint every block (``activation_checkpointing``).
* ``+fused`` (either kind): the loss through ``dsfunc.kernels.linear_cross_entropy`` (``GPTConfig.fused_loss``:
  output projection and cross-entropy a chunk of rows at a time, no fp32 logits).
* ``dsfunc`` only: ``+tiled`` computes each MLP a slice of the sequence at a time (``GPTConfig.mlp_shards``,
  slices about as long as the model is wide), ``+cpu`` keeps checkpointed activations in pinned host memory
  (``cpu_checkpointing``), ``+muon`` trains with DeepSpeed's ``"type": "Muon"`` (muon_lr 0.02, adam_lr 3e-4,
  weight decay 0.1; Newton-Schulz as DeepSpeed's default ``"gram"``, in fp16) instead of AdamW. DeepSpeed's name
  rule would give Muon the token and position embeddings (``wte``, ``wpe``; ``wte`` is also the tied output
  projection), which it means to keep on Adam; a parameter group with ``"use_muon": false`` keeps them there.

``--accum N`` accumulates N micro-batches per optimizer step (dsfunc's ``gradient_accumulation_steps``; the plain
loop sums ``loss / N``'s gradients), so the optimizer's share of a step (Muon's Newton-Schulz is per step) is
measured at a realistic number of tokens per step.

Systems run in the order given, each for ``--warmup`` then ``--steps`` timed steps; ``--rounds 2`` repeats the
list (interleaved, so drifting clocks affect all alike). One Markdown row per system and round: tokens/s,
MFU (BENCH.md's count, tied output projection included) and ``max_memory_allocated``.
``--profile`` prints each system's top ops by host and device time. ``--device cpu --model tiny`` is a smoke
run of this script (tests/test_bench.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch
from torch.utils.checkpoint import checkpoint

import dsfunc
from dsfunc.models.gpt import GPT, GPTConfig, init_weights
from dsfunc.tiling import default_shards

PEAK_FLOPS = 790e12  # bf16 matmul rate measured on these H200s (BENCH.md)


def batches(cfg: GPTConfig, micro: int, accum: int, count: int, device: torch.device):
    """``count`` steps' data, each a list of ``accum`` micro-batches."""
    g = torch.Generator(device=device).manual_seed(1234)
    for _ in range(count):
        tokens = [torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), device=device, generator=g)
                  for _ in range(accum)]
        yield [(t[:, :-1], t[:, 1:]) for t in tokens]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_model(cfg: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    model.apply(init_weights)
    return model


def run_plain(cfg: GPTConfig, options: set[str], micro: int, accum: int, warmup: int, steps: int,
              device: torch.device):
    model = make_model(dataclasses.replace(cfg, fused_loss="fused" in options), device)
    if "ckpt" in options:
        for block in model.blocks:
            block.forward = lambda x, f=block.forward: checkpoint(f, x, use_reentrant=False)
    step_model = torch.compile(model) if "compile" in options else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    losses, start = [], None
    for i, step in enumerate(batches(cfg, micro, accum, warmup + steps, device)):
        if i == warmup:
            sync(device)
            start = time.perf_counter()
            PROFILER.start()
        loss = 0.0
        for x, y in step:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                micro_loss = step_model(x, y) / accum
            micro_loss.backward()
            loss += micro_loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i in (0, warmup + steps - 1):
            losses.append(loss.item())
    sync(device)
    PROFILER.stop()
    return time.perf_counter() - start, losses, model


def run_dsfunc(cfg: GPTConfig, options: set[str], micro: int, accum: int, warmup: int, steps: int,
               device: torch.device):
    shards = default_shards(cfg.seq_len, cfg.d_model) if "tiled" in options else 0
    with torch.device("meta"):
        model = GPT(dataclasses.replace(cfg, fused_loss="fused" in options, mlp_shards=shards))
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "optimizer": MUON if "muon" in options else {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3 if "zero3" in options else 0},
        "compile": {"enabled": bool(options & {"compile", "whole"}), "scope": "model" if "whole" in options else "units",
                    "cuda_graph": "graph" in options},
    }
    policy = "units" if "units" in options else "selective" if "selective" in options else "none"
    config["activation_checkpointing"] = {"policy": policy, "cpu_checkpointing": "cpu" in options}
    groups = EMBEDDINGS_ON_ADAM if "muon" in options else None
    state = dsfunc.init_state(model, config, param_init_fn=init_weights, device=device, param_groups=groups)
    losses, start = [], None
    for i, batch in enumerate(batches(cfg, micro, accum, warmup + steps, device)):
        if i == warmup:
            sync(device)
            start = time.perf_counter()
            PROFILER.start()
        state = dsfunc.train_step(state, batch)
        if i in (0, warmup + steps - 1):
            losses.append(state.metrics.loss.item())
    sync(device)
    PROFILER.stop()
    return time.perf_counter() - start, losses, model


MUON = {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 3e-4, "weight_decay": 0.1}}
EMBEDDINGS_ON_ADAM = dsfunc.ParamGroups(
    label=lambda name: "embeddings" if name.startswith(("wte.", "wpe.")) else "blocks",
    options={"embeddings": {"use_muon": False}},
)
RUNNERS = {"plain": run_plain, "dsfunc": run_dsfunc}


class Profiler:
    """With ``--profile``: torch.profiler over each system's timed steps, then its top ops by host and by
    device time (where a slower step spends it)."""

    def __init__(self) -> None:
        self.enabled, self.prof = False, None

    def start(self) -> None:
        if self.enabled:
            self.prof = torch.profiler.profile()
            self.prof.__enter__()

    def stop(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        averages = self.prof.key_averages()
        for key in ("self_cpu_time_total", "self_device_time_total"):
            print(averages.table(sort_by=key, row_limit=12, max_name_column_width=60), flush=True)
        self.prof = None


PROFILER = Profiler()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1.3b", choices=["124m", "1.3b", "6.7b", "tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--systems", default="plain,plain+compile,dsfunc,dsfunc+compile")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--seq", type=int, default=0, help="the sequence length (default: the preset's)")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="print each system's top ops (host and device)")
    args = parser.parse_args()
    PROFILER.enabled = args.profile
    device = torch.device(args.device)
    tiny = GPTConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=2, d_model=64)
    cfg = tiny if args.model == "tiny" else GPTConfig.preset(args.model)
    cfg = dataclasses.replace(cfg, seq_len=args.seq) if args.seq else cfg
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{args.model} on {name}, torch {torch.__version__}, micro {args.micro}, accum {args.accum}, "
          f"seq {cfg.seq_len}")
    print("| size | system | round | tokens/s | MFU | peak GiB | loss first->last |")
    print("|---|---|---|---|---|---|---|")
    for round_ in range(1, args.rounds + 1):
        for system in args.systems.split(","):
            kind, *options = system.split("+")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            torch._dynamo.reset()
            elapsed, losses, model = RUNNERS[kind](cfg, set(options), args.micro, args.accum, args.warmup,
                                                   args.steps, device)
            tokens = args.micro * args.accum * cfg.seq_len * args.steps / elapsed
            mfu = tokens * model.flops_per_token() / PEAK_FLOPS
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            print(f"| {args.model} | {system} | {round_} | {tokens:,.0f} | {mfu:.3f} | {peak:.1f} | "
                  f"{losses[0]:.3f}->{losses[-1]:.3f} |", flush=True)
            del model


if __name__ == "__main__":
    main()
