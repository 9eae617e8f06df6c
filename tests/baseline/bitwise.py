"""Bitwise baseline: 20 steps at ZeRO 0-3 on 2 gloo ranks, fp32/bf16/fp16, through train_step and the engine.

``python -m tests.baseline.bitwise`` records a fingerprint (sha256 of every full parameter's bytes, and the
losses) of each run into ``bitwise.json``; ``tests/test_bitwise_baseline.py`` trains the same runs again
and compares. A refactoring that changes no arithmetic leaves every fingerprint as it was.

The bytes depend on the machine as well as on the code: torch's CPU kernels round differently on different
processors (an AMD EPYC and an Intel Xeon, both AVX-512, disagree in every run). So each record is kept
under :func:`machine` and a machine without one is not compared: record it with code known to match another
machine's record (a commit whose test passed there), not with the code under test.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

RECORD = Path(__file__).with_name("bitwise.json")
STEPS, MICRO, GAS, WORLD = 20, 2, 2, 2
STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
APIS = ("train_step", "engine")


def machine() -> str:
    """What the fingerprints depend on besides the code: torch's version, the CPU's vendor and ISA level."""
    vendor = platform.processor() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        vendor = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                       if line.startswith("vendor_id")), vendor)
    return f"torch {torch.__version__}, {vendor}, {torch.backends.cpu.get_cpu_capability()}"


def records() -> dict[str, dict]:
    """Every machine's recorded fingerprints, by :func:`machine`."""
    return json.loads(RECORD.read_text()) if RECORD.is_file() else {}


def config(stage: int, precision: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":  # starts high enough to overflow, so the scaler backs off and steps skip
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 30, "loss_scale_window": 4, "hysteresis": 1}
    return cfg


def model() -> torch.nn.Module:
    from dsfunc.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16, dropout=0.1))


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 32, (WORLD * MICRO * GAS, 9), generator=g)
        mine = tokens[rank * MICRO * GAS : (rank + 1) * MICRO * GAS]
        out.append((mine[:, :-1], mine[:, 1:]))
    return out


def train(api: str, stage: int, precision: str, rank: int) -> tuple[dict, list[float]]:
    import dsfunc

    cfg, data, losses = config(stage, precision), batches(rank), []
    if api == "train_step":
        state = dsfunc.init_state(model(), cfg, seed=7)
        for batch in data:
            state = dsfunc.train_step(state, batch)
            losses.append(state.metrics.loss.item())
    else:
        engine, *_ = dsfunc.initialize(model=model(), config=cfg, seed=7)
        for x, y in data:
            for i in range(GAS):
                part = slice(i * MICRO, (i + 1) * MICRO)
                engine.backward(engine(x[part], y[part]))
                engine.step()
            losses.append(engine.state.metrics.loss.item())
        state = engine.state
    return dsfunc.full_params(state), losses


def fingerprint(params: dict, losses: list[float]) -> dict:
    def digest(t: torch.Tensor) -> str:
        return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

    return {"params": {k: digest(v) for k, v in params.items()}, "losses": [float.hex(x) for x in losses]}


def run_ranks(rank: int, world: int) -> dict[str, dict]:
    torch.set_num_threads(1)
    return {
        f"{api}/stage{stage}/{precision}": fingerprint(*train(api, stage, precision, rank))
        for api in APIS for stage in STAGES for precision in PRECISIONS
    }


def measure() -> dict[str, dict]:
    """Every run's fingerprint; both ranks must agree."""
    from tests.multiprocess import run_world

    results = run_world(run_ranks, WORLD, timeout=900)
    assert results[0] == results[1], "the two ranks ended with different parameters"
    return results[0]


if __name__ == "__main__":
    runs, saved = measure(), records()
    saved[machine()] = runs
    RECORD.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(runs)} fingerprints for {machine()} to {RECORD}", file=sys.stderr)
