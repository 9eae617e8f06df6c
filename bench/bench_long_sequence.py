"""The longest sequence that trains on one GPU at micro-batch 1, one training step a probe:

    python bench/bench_long_sequence.py --model llama-8b --systems hf+deepspeed+bf16,hf+dsfunc+bf16 --start 16384 --limit 280
    python bench/bench_long_sequence.py --model llama-1b --systems hf+deepspeed,hf+dsfunc --seqs 131072,524288
    python bench/bench_long_sequence.py --model 1.3b --systems dsfunc+zero3+units+cpu+fused+tiled
    python bench/bench_long_sequence.py --model llama-8b --systems hf+dsfunc+bf16 --seqs 262144 --device_checkpoints 4
    python bench/bench_long_sequence.py --model llama-8b --estimate 262144,524288      # counted bytes, no GPU

Models: the HF Llama shapes of ``long_hf.py`` (``llama-8b``, ``llama-1b``, ``llama-tiny``) with its systems
``hf+deepspeed`` (plain HF + DeepSpeed ZeRO-3, optimizer offload, HF's gradient checkpointing) and ``hf+dsfunc``
(dsfunc ZeRO-3, optimizer offload, checkpoints in host memory, ALST's tiled MLP and loss), ``+bf16`` for bf16 master
weights, gradients and optimizer states; or a BENCH.md GPT preset with bench_single.py's systems.
``--device_checkpoints N`` keeps the last N layers' checkpoints on the GPU in the ``hf+dsfunc`` systems (the
``activation_checkpointing`` key of that name), where the host cannot hold them all.

Each probe is one step (no warm-up: at 512K tokens one step is minutes of attention) in a fresh process (an
out-of-memory error leaves nothing behind), stopped after ``--limit`` seconds. Its outcome: ``trains``, ``out of GPU
memory``, ``killed`` (by a signal: the host's out-of-memory killer, most likely), ``slower than the limit`` (no
verdict on memory: the row says how far the step got) or ``error``. Without ``--seqs`` the sequence doubles from
``--start`` while it trains, then bisects between the longest that trained and the shortest out of memory. A row
gives the step's seconds, the peak GPU memory (``max_memory_allocated``) and the host's peak RSS (``VmHWM``).

``--estimate`` counts bytes instead of running: the model states as dsfunc's ``memory_estimate`` counts them for
hf+dsfunc's config (fitted on two tiny states of the same family, see :func:`states_bytes`), one decoder layer's
activations at that sequence (MLP whole or tiled) and the tiled loss's on the GPU, the layer checkpoints in pinned
host memory (at their exact size: dsfunc.activation_offload), the longest sequence whose checkpoints all fit the host
beside the states, and the fewest ``device_checkpoints`` that make the rest fit with the GPU total they then
make (``--device_checkpoints`` checkpoints on the GPU, and one layer's input prefetched back). Not counted: the process's own host memory (CUDA context, libraries:
a few GiB) and the allocators' fragmentation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import torch
from long_hf import LOSS_SLICE_BYTES, SHAPES, dsfunc_config, init_llama, meta_llama, tiled_causal_lm_loss
from long_hf import RUNNERS as HF_RUNNERS

from dsfunc.tiling import default_shards

GIB = 2**30
START = time.perf_counter()


def memory(device: torch.device) -> dict:
    """Peak GPU bytes so far and the host's peak resident set (``VmHWM``), in GiB."""
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return {"gpu_gib": round(peak / GIB, 2), "host_gib": round(hwm / GIB, 2)}


def run_probe(model: str, system: str, seq: int, device: torch.device, device_checkpoints: int = 0) -> None:
    """One step in this process; prints JSON lines: ``{"phase": ...}`` as the step goes, then the outcome."""
    kind, *options = system.split("+")
    if model in SHAPES:  # hf+RUNNER+OPTIONS
        kind, *options = options

    def report(phase: str) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(json.dumps({"phase": phase, "at_s": round(time.perf_counter() - START, 1), **memory(device)}),
              flush=True)

    try:
        if model in SHAPES:
            extra = {"device_checkpoints": device_checkpoints} if kind == "dsfunc" else {}
            seconds, loss = HF_RUNNERS[kind](model, seq, set(options), device, report, **extra)
        else:
            from bench_single import RUNNERS  # BENCH.md's GPT, built and stepped as bench_single.py does

            from dsfunc.models.gpt import GPTConfig

            cfg = dataclasses.replace(GPTConfig.preset(model), seq_len=seq)
            seconds, losses, _ = RUNNERS[kind](cfg, set(options), micro=1, accum=1, warmup=0, steps=1, device=device)
            loss = losses[-1]
        row = {"outcome": "trains", "seconds": round(seconds, 2), "loss": loss}
    except torch.OutOfMemoryError as e:
        row = {"outcome": "out of GPU memory", "why": str(e).splitlines()[0][:200]}
    print(json.dumps({**row, **memory(device)}), flush=True)


def probe(model: str, system: str, seq: int, limit: float, device: str, device_checkpoints: int) -> dict:
    cmd = [sys.executable, __file__, "--probe", model, system, str(seq), "--device", device,
           "--device_checkpoints", str(device_checkpoints)]
    row = {"seq": seq}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, check=False)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = _text(e.stdout), _text(e.stderr), None
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    progress = [x for x in lines if "phase" in x]
    done = [x for x in lines if "outcome" in x]
    if done:
        return {**row, **done[-1]}
    if rc is None:
        row["outcome"] = "slower than the limit"
    elif rc < 0:
        row["outcome"] = f"killed (signal {-rc})"
    else:
        row["outcome"] = "error"
        row["why"] = (err.strip().splitlines() or ["no output"])[-1][:200]
    if progress:
        last = progress[-1]
        row.update(gpu_gib=last["gpu_gib"], host_gib=last["host_gib"], got=f"{last['phase']} done at {last['at_s']} s")
    return row


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def search(model: str, system: str, args: argparse.Namespace) -> list[dict]:
    """Every probe, in order: ``--seqs``, or doubling from ``--start`` while the step trains, then bisection
    between the longest that trained and the shortest that ran out of memory (a slower step says nothing of memory:
    the search stops there)."""
    def one(seq: int) -> dict:
        row = probe(model, system, seq, args.limit, args.device, args.device_checkpoints)
        print(f"  {system} seq {seq:,}: {row['outcome']}", file=sys.stderr, flush=True)
        rows.append(row)
        return row

    rows: list[dict] = []
    if args.seqs:
        for seq in args.seqs:
            one(seq)
        return rows
    seq, low = args.start, 0
    while (row := one(seq))["outcome"] == "trains":
        low, seq = seq, seq * 2
    if row["outcome"] != "out of GPU memory":
        return rows
    high = seq
    while high - low > args.granularity:
        mid = (low + high) // 2 // args.granularity * args.granularity
        row = one(mid)
        if row["outcome"] == "trains":
            low = mid
        elif row["outcome"] == "out of GPU memory":
            high = mid
        else:
            break
    return rows


def table(model: str, system: str, rows: list[dict]) -> None:
    for r in rows:
        seconds = r.get("seconds")
        speed = f"{r['seq'] / seconds:,.0f}" if seconds else ""
        note = r.get("got") or r.get("why") or ""
        print(f"| {model} | {system} | {r['seq']:,} | {r['outcome']} | {seconds or ''} | {speed} | "
              f"{r.get('gpu_gib', '')} | {r.get('host_gib', '')} | {note} |", flush=True)
    trained = [r["seq"] for r in rows if r["outcome"] == "trains"]
    print(f"| {model} | {system} | longest that trains: {max(trained, default=0):,} | | | | | | |", flush=True)


# ---- counted bytes (--estimate) ----

def states_bytes(shape: dict, options: set[str]) -> dict[str, float]:
    """The model states' bytes under hf+dsfunc's config, as dsfunc's ``memory_estimate`` counts them: on each side
    (host, device) ``a x params + b x largest unit``, fitted on two tiny states of this family (2 and 4 layers,
    the largest unit the embedding's, as in the real shapes) and evaluated at ``shape``. The ``a`` terms are the
    bytes a parameter costs (master, moments, host gradient, the 16-bit shard kept on the device), the ``b`` terms
    what scales with the largest unit (the staging buffers, the gathered units)."""
    import dsfunc
    from dsfunc.zero import memory_estimate

    tiny = {**SHAPES["llama-tiny"], "vocab_size": 1024, "tie_word_embeddings": shape["tie_word_embeddings"]}
    points = []
    for layers in (2, 4):
        model = meta_llama({**tiny, "num_hidden_layers": layers}, 64)
        state = dsfunc.init_state(model, dsfunc_config(options), loss_fn=tiled_causal_lm_loss,
                                  param_init_fn=init_llama, device="cpu")
        units = state.program.plan.units
        points.append((sum(u.numel for u in units), max(u.numel for u in units), memory_estimate(state)))
    (psi_a, unit_a, est_a), (psi_b, _, est_b) = points
    big = meta_llama(shape, 64)
    layer = sum(p.numel() for p in big.model.layers[0].parameters())
    psi = sum(p.numel() for p in big.parameters())
    out = {"params": psi}
    for side in ("host", "device"):
        a = (est_b[side] - est_a[side]) / (psi_b - psi_a)
        b = (est_a[side] - a * psi_a) / unit_a
        out[side] = a * psi + b * (psi - shape["num_hidden_layers"] * layer)  # the root unit: embedding, head, norm
        out[f"{side}_per_param"] = a
    return out


def activation_bytes(shape: dict, seq: int) -> dict[str, float]:
    """bf16 activations counted at ``seq`` tokens (micro-batch 1; approximate: the big tensors only). ``layer``: one
    decoder layer's recompute and backward (its input back from the host, norms, q/k/v before and after RoPE,
    attention's output and fp32 log-sum-exp, the residual, the gradients flowing through); ``mlp``: its MLP's gate,
    up, activation and product with two of their gradients, for the whole sequence or, tiled, for one slice (ALST's:
    about as many tokens as the model is wide) plus the tiled MLP's input, its gradient and the weights' gradients
    summed in fp32; ``loss``: one loss slice's logits (bf16, fp32, fp32 gradient), the last hidden states with their
    gradient and the head's gradient summed in fp32; ``checkpoint``: one layer's saved input (cpu_checkpointing keeps
    it in a pinned host buffer of its exact size)."""
    h, inter, heads, vocab = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"], \
        shape["vocab_size"]
    kv = shape["num_key_value_heads"] * h // heads
    layer = seq * (10 * h + 4 * kv) * 2 + seq * h * 4 + heads * seq * 4
    slice_tokens = math.ceil(seq / default_shards(seq, h))
    loss_tokens = math.ceil(seq / math.ceil(seq * vocab * 4 / LOSS_SLICE_BYTES))
    return {"layer": layer, "mlp": seq * inter * 2 * 6,
            "mlp_tiled": slice_tokens * inter * 2 * 6 + seq * h * 2 * 2 + 3 * h * inter * 4,
            "loss": loss_tokens * vocab * (2 + 4 + 4) + seq * h * 2 * 2 + vocab * h * 4,
            "checkpoint": seq * h * 2}


def gpu_total(states: dict, act: dict, mlp: str, kept: int, layers: int) -> float:
    """The GPU's bytes: the states, the larger of a layer's backward (MLP ``mlp``) and the loss, ``kept``
    checkpoints and, while some are on the host, one layer's input prefetched back."""
    return states["device"] + max(act["layer"] + act[mlp], act["loss"]) + (kept + (kept < layers)) * act["checkpoint"]


def estimate(model: str, seqs: list[int], host_gib: float, gpu_gib: float, device_checkpoints: int,
             process_gib: float) -> None:
    if model not in SHAPES:
        raise SystemExit(f"--estimate counts the HF Llama shapes ({', '.join(SHAPES)}), not {model!r}")
    shape = SHAPES[model]
    layers = shape["num_hidden_layers"]
    host_cap, gpu_cap = (host_gib - process_gib) * GIB, gpu_gib * GIB  # the process's own host memory comes first

    def g(x: float) -> str:
        return f"{x / GIB:.1f}"

    for options, name in ((set(), "fp32 master + Adam states"), ({"bf16"}, "bf16 master + states (+bf16)")):
        states = states_bytes(shape, options)
        print(f"\n{model} ({states['params'] / 1e9:.2f} B params), hf+dsfunc, {name}: host {states['host'] / GIB:.1f} "
              f"GiB ({states['host_per_param']:.1f} B/param + staging), device {states['device'] / GIB:.1f} GiB "
              f"({states['device_per_param']:.1f} B/param + gathered units); {device_checkpoints} device checkpoints")
        print("| seq | GPU: states | layer | MLP whole / tiled | loss (tiled) | GPU total whole / tiled | "
              f"host: states | checkpoints | host total | fits {host_gib:.0f} GiB host less {process_gib:g} | fewest "
              f"device_checkpoints "
              f"for the host: GPU tiled then | longest seq the host fits (all checkpoints there) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        room = host_cap - states["host"]
        longest = max(0, int(room // layers // (shape["hidden_size"] * 2)))
        for seq in seqs:
            act = activation_bytes(shape, seq)
            ckpt = act["checkpoint"]
            on_host = layers - device_checkpoints
            whole, tiled = (gpu_total(states, act, mlp, device_checkpoints, layers) for mlp in ("mlp", "mlp_tiled"))
            host = states["host"] + on_host * ckpt
            verdict = "yes" if host <= host_cap else f"no: {g(host - host_cap)} GiB over"
            over = "" if tiled <= gpu_cap else f" (over {gpu_gib:.0f} GiB)"
            fewest = min(layers, max(0, layers - int(room // ckpt))) if room > 0 else None
            if fewest is None or states["host"] + (layers - fewest) * ckpt > host_cap:
                needed = "none: the states alone are over"
            else:
                then = gpu_total(states, act, "mlp_tiled", fewest, layers)
                needed = f"{fewest}: {g(then)} GiB, " + ("fits" if then <= gpu_cap else f"over {gpu_gib:.0f} GiB")
            print(f"| {seq:,} | {g(states['device'])} | {g(act['layer'])} | {g(act['mlp'])} / {g(act['mlp_tiled'])} | "
                  f"{g(act['loss'])} | {g(whole)} / {g(tiled)}{over} | {g(states['host'])} | {g(on_host * ckpt)} | "
                  f"{g(host)} | {verdict} | {needed} | {longest:,} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1.3b", help=f"a GPT preset (1.3b, 6.7b, ...) or one of {', '.join(SHAPES)}")
    parser.add_argument("--systems", default="dsfunc+zero3+units+cpu+fused,dsfunc+zero3+units+cpu+fused+tiled")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--start", type=int, default=16384)
    parser.add_argument("--granularity", type=int, default=8192)
    parser.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="probe exactly these lengths (comma-separated), no search")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds a probe may run before it is stopped")
    parser.add_argument("--estimate", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="print counted bytes at these lengths (no GPU) and exit")
    parser.add_argument("--host_gib", type=float, default=125.0,
                        help="the host memory --estimate compares with (the H100 machines show 125 GiB)")
    parser.add_argument("--process_gib", type=float, default=2.2,
                        help="host memory the process holds besides states and checkpoints (--estimate; measured: 94.0 GiB at 8B and 131,072 tokens, 2.2 above them)")
    parser.add_argument("--gpu_gib", type=float, default=80.0, help="the GPU memory --estimate compares with")
    parser.add_argument("--device_checkpoints", type=int, default=0,
                        help="hf+dsfunc systems: the last N layers keep their checkpoints on the GPU (--estimate: "
                             "counted on the GPU)")
    parser.add_argument("--probe", nargs=3, metavar=("MODEL", "SYSTEM", "SEQ"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.estimate is not None:
        estimate(args.model, args.estimate, args.host_gib, args.gpu_gib, args.device_checkpoints, args.process_gib)
        return
    if args.probe:
        run_probe(args.probe[0], args.probe[1], int(args.probe[2]), torch.device(args.device), args.device_checkpoints)
        return
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    total = torch.cuda.get_device_properties(0).total_memory / GIB if args.device == "cuda" else 0
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    print(f"{args.model} on {name} ({total:.0f} GiB, host {host:.0f} GiB), torch {torch.__version__}, micro 1, "
          f"one step a probe, limit {args.limit:.0f} s")
    print("| model | system | seq | outcome | step s | tokens/s | peak GPU GiB | peak host GiB | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for system in args.systems.split(","):
        table(args.model, system, search(args.model, system, args))


if __name__ == "__main__":
    main()
