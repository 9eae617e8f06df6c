"""Per-rank memory (counted bytes) and tokens/s of a Hugging Face Qwen3-MoE under AutoEP against plain ZeRO, in one
process group (issue 46).

    torchrun --nproc_per_node 2 bench/bench_ep.py --model qwen3moe-small --shapes dp2:3,ep2:1,ep2:2,ep2:3
    torchrun --nproc_per_node 4 bench/bench_ep.py --model qwen3moe-small --shapes dp4:3,ep4:1,ep4:2,ep4:3,ep2:3

A shape is ``dpN:STAGE`` (the unmodified HF model, ZeRO stage STAGE over all N ranks) or ``epN:STAGE`` (the same
model with AutoEP, ``expert_parallel.autoep_size`` N: each MoE block's experts split over N consecutive ranks, the
strided rest of the world their expert-data-parallel replicas, ZeRO over those replicas for the experts and over
all ranks for the rest). The model, the batches and the byte counting are bench_mesh's (the same storages,
counted after the last step, not a formula); ``experts`` is the part of ``master`` in the experts' units.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch.distributed as dist
from bench_mesh import (  # one model, one count
    MODELS,
    measure,
    nbytes,
    parse_and_join,
    parse_shape,
    qwen3_moe,
    report,
)

import dsfunc


def run_shape(model_name: str, sizes: dict[str, int], stage: int, args: argparse.Namespace) -> dict[str, Any]:
    world = dist.get_world_size()
    if set(sizes) - {"dp", "ep"} or sizes.get("dp", world) != world:
        raise SystemExit(f"bad shape {sizes}: a shape is dp{world}:STAGE (plain ZeRO) or epN:STAGE (AutoEP)")
    ep = sizes.get("ep", 0)
    model = qwen3_moe(model_name, args.seq).to(args.device)  # the HF model as it is; AutoEP swaps its blocks
    config = {"train_batch_size": args.batch, "train_micro_batch_size_per_gpu": args.batch // world,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "steps_per_print": None}
    if ep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    state = dsfunc.init_state(model, config)
    state, mine, losses = measure(state, dsfunc.shard(), model_name, args, dist.get_rank(), world)
    mine["experts"] = nbytes([t for name, t in state.params.items() if name.endswith(".experts")]) if ep else None
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    row = {"shape": f"ep{ep}" if ep else f"dp{world}", "stage": stage, "model": model_name, "ranks": ranks,
           "losses": losses, "params": sum(p.numel() for p in model.parameters()) if not ep else None,
           "units": {name: list(t.shape) for name, t in state.params.items()}}
    del state
    gc.collect()
    return row


def markdown(row: dict[str, Any], args: argparse.Namespace, world: int) -> str:
    def mib(key: str) -> str:
        if row["ranks"][0][key] is None:  # plain ZeRO: the experts share their layer's unit
            return "—"
        return f"{max(r[key] for r in row['ranks']) / 2**20:.2f}"

    keys = ("master", "compute", "grads", "optimizer", "activations")
    total = max(sum(r[k] for k in keys) for r in row["ranks"])
    step = max(r["step_s"] for r in row["ranks"])
    ep = int(row["shape"][2:]) if row["shape"].startswith("ep") else 0
    shape = row["shape"] + (f" x edp {world // ep}" if ep and ep < world else "")
    return (f"| {row['model']} | {world} | {shape} | {row['stage']} | {mib('master')} | {mib('experts')} | "
            f"{mib('compute')} | {mib('grads')} | {mib('optimizer')} | {mib('activations')} | "
            f"{total / 2**20:.2f} | {step * 1e3:.0f} | {args.batch * args.seq / step:,.0f} | "
            f"{row['losses'][0]:.4f} -> {row['losses'][-1]:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[m for m in MODELS if m.startswith("qwen3moe")], default="qwen3moe-tiny")
    parser.add_argument("--shapes", default="dp2:3,ep2:1,ep2:2,ep2:3")
    args = parse_and_join(parser)
    world = dist.get_world_size()
    rows = [run_shape(args.model, *parse_shape(s, 3), args) for s in args.shapes.split(",")]
    if dist.get_rank() == 0:
        params = next((r["params"] for r in rows if r["params"]), None)
        print(f"{args.model}{f', {params:,} parameters' if params else ''}, global batch {args.batch} x {args.seq} "
              f"tokens, {world} {args.device.type} ranks; MiB on the largest rank")
    report(["model", "ranks", "shape", "ZeRO", "master", "of it experts", "compute", "grads", "optimizer",
            "activations", "total", "step ms", "tokens/s", "loss"], [markdown(row, args, world) for row in rows], rows, args)


if __name__ == "__main__":
    main()
