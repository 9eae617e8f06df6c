"""The "24 GB GPU": the largest BENCH.md-style GPT that trains on one GPU capped to ``--cap_gib``, without
offload, with optimizer offload and with optimizer + parameter offload; DeepSpeed ZeRO-Offload on a model.

    python bench/bench_offload.py --cap_gib 24 --trials opt+param:40x3584,deepspeed:32x2560,none:24x2048/32x2560

Every trial is a process of its own (``--one SHAPE SETTING SYSTEM``), so a failed allocation, pinned host
memory and the memory cap stay with it. ``--trials`` lists, per setting, sizes (``LxD``: L layers of width
D) to try in order, stopping at the first that does not fit. All trials: ZeRO-3 on one GPU, bf16 with fp32 master weights, AdamW lr 3e-4, clipping
1.0, every block checkpointed (dsfunc's ``activation_checkpointing`` policy "units"; for DeepSpeed,
``torch.utils.checkpoint`` around each block), micro-batch ``--micro`` of 1024 random tokens (``--accum``
micro-batches per step), 2 warm-up
steps and ``--steps`` timed steps. Settings: ``none``, ``opt`` (``offload_optimizer`` to pinned CPU
memory), ``opt+param`` (and ``offload_param``); ``+bf16`` added to either (``opt+bf16``, ``opt+bf16+spec``) keeps the
master weights, gradients and AdamW moments in bf16 (``bf16_master_weights_and_grads``, ``bf16_optimizer_states``,
for DeepSpeed too: 8 host bytes a parameter instead of 16-17); ``+spec`` added to either (``opt+spec``, ``opt+param+spec``) turns
on dsfunc's ``offload_optimizer.speculative_update`` (each unit's host update during backward, redone where the
step clips or skips; the last column then says how many units' updates of the last step stood and were redone,
and the host bytes their saved copies take; ``--ahead`` bounds the elements that run ahead, as the copies of every
unit's state do not fit beside 6B parameters' in 128 GiB of host memory). The entry ``deepspeed:SHAPE`` runs DeepSpeed 0.19.x's engine
with ZeRO-Offload (its DeepSpeedCPUAdam, built on first use) on SHAPE with the ``opt`` setting, beside
dsfunc's trial of the same shape and setting; ``deepspeed-SETTING:SHAPE`` with another setting. DeepSpeed
builds the model under ``deepspeed.zero.Init`` (partitioned as it is made, its documented way for models
that do not fit one device), then initialises it as dsfunc does, one module gathered at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

PEAK_FLOPS = 790e12  # bf16 matmul rate measured on these H200s (BENCH.md)
ACCUM = [1]  # --accum: micro-batches per optimizer step (set once by main)
BF16_STATES = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}  # the +bf16 setting
OPTIONS = {"device_sums": 0, "backward_group": 1, "profile": False, "ahead": 0, "clip": 1.0, "stacks": "",
           "trial": ""}  # flags (set by main; "trial" by one())


def shape(name: str):
    from dsfunc.models.gpt import GPTConfig

    layers, width = (int(v) for v in name.split("x"))
    return GPTConfig(n_layer=layers, d_model=width, n_head=width // 128)


def zero_section(setting: str) -> dict:
    section = {"stage": 3}
    if "opt" in setting.split("+"):
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if "param" in setting.split("+"):
        section["offload_param"] = {"device": "cpu", "pin_memory": True}
    return section


def config(micro: int, setting: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": ACCUM[0],
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "gradient_clipping": OPTIONS["clip"],
        "bf16": {"enabled": True, **(BF16_STATES if "bf16" in setting.split("+") else {})},
        "zero_optimization": zero_section(setting),
        "steps_per_print": 10**9,
    }


def batches(cfg, micro: int, count: int):
    g = torch.Generator(device="cuda").manual_seed(1234)
    for _ in range(count):
        tokens = torch.randint(0, cfg.vocab_size, (micro * ACCUM[0], cfg.seq_len + 1), device="cuda", generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def timed(step, cfg, micro: int, steps: int) -> tuple[float, list[float]]:
    losses, start = [], None
    with contextlib.ExitStack() as stack:
        for i, batch in enumerate(batches(cfg, micro, 2 + steps)):
            if i == 2:
                torch.cuda.synchronize()
                start = time.perf_counter()
                if OPTIONS["stacks"]:
                    stack.enter_context(sampled_stacks(Path(OPTIONS["stacks"]) / stacks_name(OPTIONS["trial"])))
            losses.append(step(batch))
        torch.cuda.synchronize()
    return time.perf_counter() - start, losses


@contextlib.contextmanager
def sampled_stacks(path: Path, every: float = 0.5):
    """Every thread's Python stack written to ``path`` each ``every`` seconds (a sampler with nothing to install:
    where the timed steps' host threads wait, e.g. the main thread against the host update's worker). A thread of
    its own reads ``sys._current_frames()`` holding the interpreter's lock: ``faulthandler.dump_traceback_later``,
    which reads the frames without it, crashed processes here (SIGSEGV within seconds at 0.01-0.02 s a dump, with
    or without the speculative update; a speculative trial sampled so on the H100 ended by SIGSEGV too). Each
    sample: a "---" line, then each other thread's stack, most recent call last."""
    done = threading.Event()

    def sample(f) -> None:
        while not done.wait(every):
            f.write(f"--- {time.perf_counter():.3f}\n")
            for ident, frame in sys._current_frames().items():
                if ident != threading.get_ident():
                    f.write(f"Thread {ident:#x}\n{''.join(traceback.format_stack(frame))}\n")

    with path.open("w") as f:
        sampler = threading.Thread(target=sample, args=(f,), daemon=True)
        sampler.start()
        try:
            yield
        finally:
            done.set()
            sampler.join()


def run_dsfunc(cfg, setting: str, micro: int, steps: int):
    import dsfunc
    from dsfunc.models.gpt import GPT, init_weights

    with torch.device("meta"):  # the loss through dsfunc's chunked op: no fp32 logits on the capped GPU
        model = GPT(dataclasses.replace(cfg, fused_loss=True))
    cfg_ds = {**config(micro, setting), "activation_checkpointing": {"policy": "units"}}
    offload = cfg_ds["zero_optimization"].get("offload_optimizer")
    if offload is not None:
        offload.update(grad_accumulation_on_device=OPTIONS["device_sums"],
                       micro_batches_per_backward=OPTIONS["backward_group"],
                       speculative_update="spec" in setting.split("+") and (OPTIONS["ahead"] or True))
    box = [dsfunc.init_state(model, cfg_ds, param_init_fn=init_weights, device="cuda")]

    def step(batch) -> float:
        box[0] = dsfunc.train_step(box[0], batch)
        return box[0].metrics.loss

    elapsed, losses = timed(step, cfg, micro, steps)
    host = getattr(box[0].program.run.runner, "host", None)  # the run's HostOffload, if offloaded
    host_update = None if host is None else host.executor.seconds  # the last step's, in the worker
    if host is not None and host.speculation is not None:  # the last step's units kept, redone, late; spare bytes
        spec = host.speculation
        host_update = (host_update, len(spec.stood), len(spec.undone), len(spec.late), spec.host_bytes() / 2**30)
    if OPTIONS["profile"]:
        print(json.dumps({"profile": busy(step, next(batches(cfg, micro, 1)))}), flush=True)
    return elapsed, [float(x) for x in losses], model.flops_per_token(), host_update


def busy(step, batch) -> dict:
    """One more step under torch's profiler: its seconds, and the seconds the device spent in kernels, in copies to
    the host and in copies from it (each the union of its intervals, so copies on two streams count once)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step(batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    spans: dict[str, list[tuple[float, float]]] = {"kernels": [], "to host": [], "from host": []}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        kind = "to host" if "DtoH" in e.name else "from host" if "HtoD" in e.name else "kernels"
        spans[kind].append((e.time_range.start, e.time_range.end))
    out = {"step s": wall, **{f"{kind} s": union(s) / 1e6 for kind, s in spans.items()}}
    out["copies s"] = union(spans["to host"] + spans["from host"]) / 1e6
    out["anything s"] = union([i for s in spans.values() for i in s]) / 1e6
    return out


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def run_deepspeed(cfg, setting: str, micro: int, steps: int):
    import deepspeed
    from torch.utils.checkpoint import checkpoint

    from dsfunc.models.gpt import GPT, init_weights

    deepspeed.init_distributed(dist_backend="nccl")
    config_ds = config(micro, setting)
    with deepspeed.zero.Init(config_dict_or_path=config_ds):
        model = GPT(cfg)
    for module in model.modules():  # the same initialisation as dsfunc's, one module gathered at a time
        with deepspeed.zero.GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=0):
            init_weights(module)
    for block in model.blocks:
        block.forward = lambda x, f=block.forward: checkpoint(f, x, use_reentrant=False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config_ds)

    def step(batch) -> float:
        for x, y in zip(*(t.chunk(ACCUM[0]) for t in batch)):  # DeepSpeed steps at the accumulation boundary
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        return loss.detach()

    elapsed, losses = timed(step, cfg, micro, steps)
    engine.destroy()
    with torch.device("meta"):  # DeepSpeed's partitioned parameters count as empty
        flops = GPT(cfg).flops_per_token()
    return elapsed, [float(x) for x in losses], flops, None


def one(size: str, setting: str, system: str, cap_gib: float, micro: int, steps: int) -> None:
    """One trial in this process: print one JSON line with what it measured (or why it failed)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    cfg = shape(size)
    OPTIONS["trial"] = f"{size}-{setting}-{system}"
    try:
        runner = run_deepspeed if system == "deepspeed" else run_dsfunc
        elapsed, losses, flops, host_update = runner(cfg, setting, micro, steps)
    except torch.OutOfMemoryError as e:
        print(json.dumps({"fits": False, "why": str(e).splitlines()[0][:160]}))
        return
    tokens = micro * ACCUM[0] * cfg.seq_len * steps / elapsed
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**20
    print(json.dumps({"fits": True, "tokens": tokens, "mfu": tokens * flops / PEAK_FLOPS,
                      "peak": torch.cuda.max_memory_allocated() / 2**30, "host": rss,
                      "loss": [losses[0], losses[-1]], "host_update": host_update}))


def trial(size: str, setting: str, system: str, args) -> dict:
    cmd = [sys.executable, __file__, "--one", size, setting, system, "--cap_gib", str(args.cap_gib),
           "--micro", str(args.micro), "--accum", str(args.accum), "--steps", str(args.steps),
           "--device_sums", str(args.device_sums), "--backward_group", str(args.backward_group),
           "--ahead", str(args.ahead), "--clip", str(args.clip), "--stacks", args.stacks,
           *(["--profile"] if args.profile else [])]
    try:
        # a trial killed by a signal prints every thread's Python stack (faulthandler) below the table
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.trial_timeout, check=False,
                              env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    except subprocess.TimeoutExpired:
        return {"fits": False, "why": f"over {args.trial_timeout} s"}
    if proc.returncode < 0:
        print(f"{size} {setting} {system} ended by signal {-proc.returncode}; its stderr ends:", flush=True)
        print("\n".join(proc.stderr.strip().splitlines()[-60:]), flush=True)
    for line in proc.stdout.splitlines():
        if line.startswith('{"profile"'):
            print(f"profile of one more step ({size} {setting} {system}): {line}", flush=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"fits"')]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"fits": False, "why": f"exit {proc.returncode}: {' / '.join(tail)[:300]}"}
    return json.loads(lines[-1])


def billions(size: str) -> float:
    c = shape(size)
    return (12 * c.n_layer * c.d_model**2 + c.vocab_size * c.d_model) / 1e9


def row(size: str, setting: str, system: str, r: dict) -> str:
    if not r["fits"]:
        return f"| {size} ({billions(size):.1f}B) | {system} | {setting} | does not fit: {r['why']} | | | | | |"
    return (f"| {size} ({billions(size):.1f}B) | {system} | {setting} | {r['tokens']:,.0f} | {r['mfu']:.3f} | "
            f"{r['peak']:.1f} | {r['host']:.1f} | {r['loss'][0]:.3f}->{r['loss'][1]:.3f} | "
            f"{host_update(r.get('host_update'))} |")


def stacks_name(trial: str) -> str:
    """The stack samples' file of a trial: its name with "_" for "+" (the device tool returns no file whose name
    holds a "+")."""
    return f"stacks-{trial.replace('+', '_')}.txt"


def host_update(measured) -> str:
    """The host update column: seconds in the worker; with speculation, units kept / redone / begun too late to
    run ahead, and the GiB of spare buffers."""
    if measured is None:
        return ""
    if isinstance(measured, list):
        seconds, kept, redone, late, spare = measured
        return f"{seconds:.2f} (speculated: {kept} kept, {redone} redone, {late} late, {spare:.1f} GiB spare)"
    return format(measured, ".2f")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cap_gib", type=float, default=24.0)
    parser.add_argument("--trials", default="none:24x2048/32x2560,opt:32x2560/32x3200/40x3584,opt+param:40x3584,"
                                          "deepspeed:32x2560")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trial_timeout", type=float, default=240)
    parser.add_argument("--device_sums", type=float, default=0,
                        help="dsfunc's offload_optimizer.grad_accumulation_on_device (elements)")
    parser.add_argument("--backward_group", type=int, default=1,
                        help="dsfunc's offload_optimizer.micro_batches_per_backward")
    parser.add_argument("--profile", action="store_true", help="print where one more step's device time goes")
    parser.add_argument("--ahead", type=float, default=0,
                        help="+spec: elements of the units whose update runs ahead (0: every unit)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: off), both systems")
    parser.add_argument("--stacks", default="", help="a folder: each trial samples its timed steps' thread stacks "
                                                      "into stacks-SIZE-SETTING-SYSTEM.txt there, '+' as '_'")
    parser.add_argument("--one", nargs=3, metavar=("SIZE", "SETTING", "SYSTEM"))
    args = parser.parse_args()
    ACCUM[0] = args.accum
    OPTIONS.update(device_sums=int(args.device_sums), backward_group=args.backward_group, profile=args.profile,
                   ahead=int(args.ahead), clip=args.clip, stacks=args.stacks)
    if args.one:
        one(*args.one, args.cap_gib, args.micro, args.steps)
        return
    print(f"{torch.cuda.get_device_name()} capped to {args.cap_gib} GiB, torch {torch.__version__}, "
          f"micro {args.micro} x 1024 tokens x accumulation {args.accum}, {args.steps} timed steps, "
          f"dsfunc's sums on the device: {int(args.device_sums):,} elements, micro-batches per backward: "
          f"{args.backward_group}")
    print("| model | system | offload | tokens/s | MFU | peak GiB (GPU) | peak GiB (host RSS) | loss | host update s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for entry in args.trials.split(","):
        setting, _, sizes = entry.partition(":")
        if setting.startswith("deepspeed"):
            compared = setting.partition("-")[2] or "opt"
            for system in ("dsfunc", "deepspeed"):
                print(row(sizes, compared, system, trial(sizes, compared, system, args)), flush=True)
            continue
        for size in sizes.split("/"):
            r = trial(size, setting, "dsfunc", args)
            print(row(size, setting, "dsfunc", r), flush=True)
            if not r["fits"]:
                break


if __name__ == "__main__":
    main()
