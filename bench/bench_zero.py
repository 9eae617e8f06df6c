"""The BENCH.md workload: dsfunc ZeRO stages against PyTorch FSDP2 and DeepSpeed, in one process group.

    torchrun --nproc_per_node 2 bench/bench_zero.py --model 1.3b --systems dsfunc:2,dsfunc:3,fsdp2,fsdp2c,deepspeed:3

Systems: ``dsfunc:S`` (ZeRO stage S; ``dsfunc:S+compile`` compiles each block, ``+units`` / ``+selective``
checkpoint every block), ``fsdp2`` (per-block ``fully_shard``), ``fsdp2c`` (the same with each
block ``torch.compile``d first, torchtitan's order), ``deepspeed:S`` (DeepSpeed's engine at ZeRO stage S
with its FusedAdam, built on first use; on the CPU its torch Adam). ``--device cpu --model tiny`` is a
gloo smoke run of this script (tests/test_bench.py).

GPT-2 style model built on ``meta`` and initialised N(0, 0.02) on each rank's GPU, bf16 compute with fp32
master weights, AdamW lr 3e-4, gradient clipping 1.0, random tokens, micro-batch 8 per GPU (4 for 6.7b),
no accumulation. 8 warm-up steps, then 30 timed steps between ``torch.cuda.synchronize()``. Prints one
Markdown row per system: tokens/s over all ranks, MFU and ``max_memory_allocated`` per rank.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist

import dsfunc
from dsfunc.models.gpt import GPT, GPTConfig, init_weights

PEAK_FLOPS = 790e12  # bf16 matmul rate measured on these H200s (BENCH.md)


def batches(cfg: GPTConfig, micro: int, count: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    for _ in range(count):
        tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), device=device, generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def run_dsfunc(cfg: GPTConfig, stage: int, micro: int, warmup: int, steps: int, device: torch.device,
               options: frozenset[str] = frozenset()):
    with torch.device("meta"):
        model = GPT(cfg)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "compile": {"enabled": "compile" in options},
        "activation_checkpointing": {"policy": "units" if "units" in options else
                                     "selective" if "selective" in options else "none"},
    }
    state = dsfunc.init_state(model, config, param_init_fn=init_weights, device=device)
    losses = []
    start = None
    for i, batch in enumerate(batches(cfg, micro, warmup + steps, device)):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        state = dsfunc.train_step(state, batch)
        if i in (0, warmup + steps - 1):
            losses.append(state.metrics.loss.item())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    extra = f"max live units {state.program.run.workspace.stats.max_live_units}" if stage == 3 else ""
    return elapsed, losses, model, extra


def run_fsdp2(cfg: GPTConfig, micro: int, warmup: int, steps: int, device: torch.device, *,
              compile_blocks: bool = False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = GPT(cfg)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        if compile_blocks:
            block.compile()
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.apply(init_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    losses = []
    start = None
    for i, (x, y) in enumerate(batches(cfg, micro, warmup + steps, device)):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i in (0, warmup + steps - 1):
            losses.append(loss.item())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return elapsed, losses, model, ""


def run_fsdp2_compiled(cfg: GPTConfig, micro: int, warmup: int, steps: int, device: torch.device):
    """FSDP2 with each block compiled before it is sharded (torchtitan's order)."""
    return run_fsdp2(cfg, micro, warmup, steps, device, compile_blocks=True)


def run_deepspeed(cfg: GPTConfig, stage: int, micro: int, warmup: int, steps: int, device: torch.device):
    """DeepSpeed's engine on the same model and data (the reference BENCH.md's DeepSpeed rows came from)."""
    import deepspeed

    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    model.apply(init_weights)
    adam = {"lr": 3e-4, "weight_decay": 0.1, **({"torch_adam": True} if device.type == "cpu" else {})}
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": adam},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    start = None
    for i, (x, y) in enumerate(batches(cfg, micro, warmup + steps, device)):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if i in (0, warmup + steps - 1):
            losses.append(loss.item())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    engine.destroy()
    return elapsed, losses, model, ""


SYSTEMS = {
    "dsfunc": ("dsfunc ZeRO-{}", run_dsfunc),
    "fsdp2": ("PyTorch FSDP2", run_fsdp2),
    "fsdp2c": ("PyTorch FSDP2 + compiled blocks", run_fsdp2_compiled),
    "deepspeed": ("DeepSpeed ZeRO-{}", run_deepspeed),
}


def _shape(name: str) -> GPTConfig:
    """A preset, or ``"LxD"``: L layers of width D with heads of 128 (the larger BENCH.md-style GPTs)."""
    if "x" not in name:
        return GPTConfig.preset(name)
    layers, width = (int(v) for v in name.split("x"))
    return GPTConfig(n_layer=layers, d_model=width, n_head=width // 128)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1.3b", help='124m, 1.3b, 6.7b, tiny, or "LxD" (L layers of width D)')
    parser.add_argument("--device", default="cuda", help="cpu runs a gloo smoke test of this script")
    parser.add_argument("--systems", default="dsfunc:2,dsfunc:3,fsdp2")
    parser.add_argument("--micro", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            setattr(torch.cuda, name, lambda: None)
        torch.cuda.max_memory_allocated = lambda: 0
        torch.cuda.get_device_name = lambda: "CPU"
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    tiny = GPTConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=2, d_model=64)
    cfg = tiny if args.model == "tiny" else _shape(args.model)
    with torch.device("meta"):  # counted on a copy: DeepSpeed's ZeRO-3 leaves its model's parameters empty
        flops_per_token = GPT(cfg).flops_per_token()
    micro = args.micro or (4 if args.model == "6.7b" else 8)
    if dist.get_rank() == 0:
        print(f"{args.model}: {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, micro {micro}")
        print("| size | GPUs | system | tokens/s | MFU | peak GiB/rank | loss first->last | note |")
        print("|---|---|---|---|---|---|---|---|")
    for system in args.systems.split(","):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        leftover = torch.cuda.memory_allocated() / 2**30
        kind, _, spec = system.partition(":")
        stage, *options = spec.split("+") if spec else [""]
        label, run = SYSTEMS[kind]
        stages = (int(stage),) if stage else ()
        extra = {"options": frozenset(options)} if options else {}
        elapsed, losses, model, note = run(cfg, *stages, micro, args.warmup, args.steps, device, **extra)
        name = label.format(stage) + "".join(f" + {o}" for o in options)
        tokens = micro * cfg.seq_len * args.steps * world / elapsed
        mfu = tokens / world * flops_per_token / PEAK_FLOPS
        peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if leftover > 0.01:
            note += f" ({leftover:.1f} GiB held before this run)"
        if dist.get_rank() == 0:
            print(f"| {args.model} | {world} | {name} | {tokens:,.0f} | {mfu:.3f} | {peak.item():.1f} | "
                  f"{losses[0]:.3f}->{losses[-1]:.3f} | {note} |", flush=True)
        del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
