"""Per-rank memory (counted bytes) and step time by mesh shape, in one process group.

    torchrun --nproc_per_node 4 bench/bench_mesh.py --model llama-small --shapes dp4,tp2xdp2,sp2xdp2,tp2xsp2
    torchrun --nproc_per_node 2 bench/bench_mesh.py --model qwen3moe-small --shapes dp2:0,dp2:3

On one node's GPUs (NCCL, a GPU a rank) add ``--device cuda``; the default is gloo on the CPU.

A shape is its mesh axes (``tp2xsp2xdp2``; the rest of the world is ``dp``) and optionally ``:STAGE``, the ZeRO
stage (default ``--stage``). ``llama-*`` is a Hugging Face Llama with grouped-query attention; ``qwen3moe-*`` a Hugging Face
Qwen3-MoE (top-2 of 8 experts), trained as it is by plain ZeRO (its expert-parallel shapes are
bench/bench_ep.py's, which reuses this model and these counts).

Every shape trains the same global batch (``--batch`` sequences of ``--seq`` tokens; each data-parallel replica
takes its slice) with fp32 AdamW and clipping. The bytes are read from the tensors each rank holds after the
last step (storage sizes, each storage once), not from a formula: ``master`` (``state.params``, this rank's
fp32 shards), ``compute`` (the copies the forward reads, when they are not the master itself), ``grads`` (the
reduced gradients handed to the update), ``optimizer`` (the Adam moments), ``activations`` (what autograd saves
during one forward, parameters excluded). Prints one Markdown row per shape (the largest rank's bytes) and with
``--json`` writes every rank's figures, the mesh and rank 0's parameter placements.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import dsfunc
import dsfunc.parallel

MODELS = {  # hidden, layers, heads, kv heads, vocab, intermediate
    "llama-tiny": (64, 2, 8, 4, 256, 128),
    "llama-small": (256, 4, 8, 4, 4096, 688),
    "qwen3moe-tiny": (64, 2, 8, 4, 256, 64),  # its experts' intermediate size
    "qwen3moe-small": (256, 4, 8, 4, 4096, 256),
}
EXPERTS = 8


def parse_shape(text: str, default_stage: int) -> tuple[dict[str, int], int]:
    """``tp2xsp2:1`` -> ({"tp": 2, "sp": 2}, 1)."""
    axes, _, stage = text.partition(":")
    sizes = {}
    for part in axes.split("x"):
        m = re.fullmatch(r"(dp|tp|sp|ep)(\d+)", part)
        if m is None:
            raise SystemExit(f"bad shape {text!r}: axes are dp, tp, sp, ep with sizes, joined by x (tp2xdp2:1)")
        sizes[m[1]] = int(m[2])
    return sizes, int(stage) if stage else default_stage


def llama(name: str, seq: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, vocab, inter = MODELS[name]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=seq,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def qwen3_moe(name: str, seq: int) -> nn.Module:
    """A Hugging Face Qwen3-MoE (top-2 of ``EXPERTS``), as it is (bench/bench_ep.py runs it under AutoEP)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hidden, layers, heads, kv, vocab, inter = MODELS[name]
    config = Qwen3MoeConfig(hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                            head_dim=hidden // heads, vocab_size=vocab, num_experts=EXPERTS, num_experts_per_tok=2,
                            max_position_embeddings=seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


def nbytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the storages under ``tensors``, each once."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())


class Counter:
    """Counts, for one step, the reduced gradients handed to the update and the bytes autograd saves during the
    forward (a storage once), but the parameters': the masters' and the compute copies' storages, looked up as
    each tensor is saved (stage 3 gathers a unit into a new storage before its forward)."""

    def __init__(self, state: dsfunc.TrainState) -> None:
        self.grads = 0
        self.saved: dict[int, int] = {}
        self.masters = {t.untyped_storage().data_ptr() for t in state.params.values()}
        self.workspace = state.program.run.workspace

    def grad_fn(self, inner):
        def grad_fn(ctx, batch):
            result = inner(ctx, batch)
            self.grads = nbytes([g for g in result.grads.values() if g is not None])
            return result

        return grad_fn

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        local = getattr(local, "elem", local)  # an AsyncCollectiveTensor's result, without waiting for it
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        computes = {b.untyped_storage().data_ptr() for b in self.workspace.buffers.values()}
        if torch._C._current_graph_task_id() == -1 and ptr not in self.masters and ptr not in computes:
            self.saved[ptr] = storage.nbytes()
        return t


def measure(state: Any, shard: Any, model_name: str, args: argparse.Namespace, replica: int,
            replicas: int) -> tuple[Any, dict[str, Any], list[float]]:
    """Train ``state`` (``args.warmup + args.steps`` steps of this replica's slice of the bench's batches, through
    ``shard``); the trained state, this rank's counted bytes and median step time, and the losses."""
    counter = Counter(state)
    step = dsfunc.make_train_step(counter.grad_fn(
        dsfunc.scale_loss()(shard(dsfunc.accumulate()(dsfunc.value_and_grad())))))
    vocab = MODELS[model_name][4]
    g = torch.Generator().manual_seed(1234)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).chunk(replicas)[replica].to(args.device)
        batch = {"input_ids": ids, "labels": ids}
        last = i == args.warmup + args.steps - 1
        dist.barrier()
        if args.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t) if last else contextlib.nullcontext():
            state = step(state, batch)
        losses.append(state.metrics.loss.item())  # waits for the step's device work
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    workspace = state.program.run.workspace
    moments = [t for t in optree.tree_leaves(state.opt_state) if t.dim() > 0]
    mine = {
        "master": nbytes(list(state.params.values())),
        "compute": 0 if workspace.aliases_master else nbytes(list(workspace.buffers.values())),
        "grads": counter.grads,
        "optimizer": nbytes(moments),
        "activations": sum(counter.saved.values()),
        "step_s": statistics.median(times),
    }
    return state, mine, losses


def run_shape(model_name: str, sizes: dict[str, int], stage: int, args: argparse.Namespace) -> dict[str, Any]:
    world = dist.get_world_size()
    if "ep" in sizes:
        raise SystemExit("expert parallelism has its own bench: bench/bench_ep.py (AutoEP against plain ZeRO)")
    tp, sp = sizes.get("tp", 1), sizes.get("sp", 1)
    dp = world // (tp * sp)
    if sizes.get("dp", dp) != dp or dp * tp * sp != world:
        raise SystemExit(f"the shape {sizes} does not cover the {world} ranks")
    moe = model_name.startswith("qwen3moe")
    model = (qwen3_moe(model_name, args.seq) if moe else llama(model_name, args.seq)).to(args.device)
    numels = {name: p.numel() for name, p in model.named_parameters()}
    config = {"train_batch_size": args.batch, "train_micro_batch_size_per_gpu": args.batch // dp,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "steps_per_print": None}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    if sp > 1:
        config["sequence_parallel_size"] = sp
    # torch's mesh, given to init_state and to the step's shard() (the config's axes must agree with it)
    names = tuple(a for a in ("dp", "sp", "tp") if a == "dp" or sizes.get(a, 1) > 1)
    device_mesh = init_device_mesh(args.device.type, tuple({"dp": dp, "sp": sp, "tp": tp}[a] for a in names),
                                   mesh_dim_names=names)
    state = dsfunc.init_state(model, config, mesh=device_mesh)
    mesh = state.program.mesh
    replica = mesh.group("dp").rank
    state, mine, losses = measure(state, dsfunc.shard(mesh=device_mesh), model_name, args, replica, dp)
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    row = {"shape": "x".join(f"{a}{n}" for a, n in sizes.items()), "stage": stage, "model": model_name,
           "mesh": mesh.describe(), "grid": device_mesh.mesh.tolist(), "dims": list(names),
           "groups": {a: list(mesh.group(a).ranks) for a in ("dp", "sp", "tp", "dp_sp")}, "ranks": ranks, "losses": losses,
           "params": sum(numels.values()), "numels": numels,
           "units": {name: list(t.shape) for name, t in state.params.items()}}
    if not moe:
        row["placements"] = dsfunc.parallel.placements(state)
    del state
    gc.collect()
    return row


def markdown(row: dict[str, Any], args: argparse.Namespace) -> str:
    def mib(key: str) -> float:
        return max(r[key] for r in row["ranks"]) / 2**20

    total = max(sum(r[k] for k in ("master", "compute", "grads", "optimizer", "activations")) for r in row["ranks"])
    step = max(r["step_s"] for r in row["ranks"])
    tokens = args.batch * args.seq / step
    return (f"| {row['model']} | {row['shape']} | {row['stage']} | {mib('master'):.2f} | {mib('compute'):.2f} | "
            f"{mib('grads'):.2f} | {mib('optimizer'):.2f} | {mib('activations'):.2f} | {total / 2**20:.2f} | "
            f"{step * 1e3:.0f} | {tokens:,.0f} | {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f} |")


def parse_and_join(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments every mesh bench takes (batch, sequence, steps, output, device) added to ``parser`` and parsed;
    the world joined (gloo on the CPU, NCCL with ``--device cuda``, one GPU a rank)."""
    parser.add_argument("--batch", type=int, default=8, help="global batch, sequences")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="write every rank's figures here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by a launcher; unused")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dsfunc.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo", verbose=False)
    args.device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    return args


def report(columns: list[str], lines: list[str], rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Rank 0 prints the Markdown table (``lines`` under ``columns``) and writes ``--json``; then the world ends."""
    if dist.get_rank() == 0:
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        print("\n".join(lines))
        if args.json:
            Path(args.json).write_text(json.dumps({"batch": args.batch, "seq": args.seq, "rows": rows}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="llama-tiny")
    parser.add_argument("--shapes", default="dp4,tp2xdp2,sp2xdp2,tp2xsp2")
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage of a shape that names none")
    args = parse_and_join(parser)
    rows = [run_shape(args.model, *parse_shape(s, args.stage), args) for s in args.shapes.split(",")]
    if dist.get_rank() == 0:
        print(f"{args.model}, {rows[0]['params']:,} parameters, global batch {args.batch} x {args.seq} tokens, "
              f"{dist.get_world_size()} {args.device.type} ranks; MiB on the largest rank")
    report(["model", "shape", "ZeRO", "master", "compute", "grads", "optimizer", "activations", "total", "step ms",
            "tokens/s", "loss"], [markdown(row, args) for row in rows], rows, args)


if __name__ == "__main__":
    main()
