"""Write ``fixtures.tar.xz``: real DeepSpeed checkpoints and DeepSpeed's own resumed runs from them.

Run from the repository root, with DeepSpeed installed (``.ci/setup_test_tools.sh``) and transformers::

    DS_ACCELERATOR=cpu python -m tests.checkpoint.deepspeed.make_fixtures [CASE ...]

For every case of ``common.CASES`` (and a tiny GPT-2 for the Hugging Face export), on ``case.world`` gloo
ranks: DeepSpeed trains ``SAVE_AT`` steps and saves ``<case>/global_step3`` with ``common.CLIENT`` as
client state; a fresh engine loads it and trains ``RESUMED`` more steps, and ``<case>/reference.pt``
records that resumed run's global mean loss per step and its final fp32 master weights (and the loss
scaler's state at the save). Stage-0 checkpoints, which DeepSpeed can resume at another world size, are
also resumed by DeepSpeed on the other of 1 and 2 ranks (``reference_w<W>.pt``). The GPT-2 case records
its config (``gpt2/hf_config/config.json``) and the logits of its fp32 master weights instead. With case
names (``s2_w2_fp16 gpt2``), only those are made again and the others kept from the existing archive.
Nothing is pruned: what the tests read is exactly what DeepSpeed 0.19.8 wrote (DeepSpeed's copy of
``zero_to_fp32.py`` next to each save is left out).
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist

from tests.checkpoint.deepspeed.common import (
    CASES,
    CLIENT,
    FIXTURES,
    GPT2,
    GPT2_INPUT,
    MATRIX,
    RESUMED,
    SAVE_AT,
    Case,
    Net,
    batch,
    extract,
    rank_slice,
)
from tests.multiprocess import run_world


def engine_for(model: torch.nn.Module, config: dict):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def master_weights(engine) -> dict[str, torch.Tensor]:
    """The fp32 master weights of every trainable parameter (a collective at ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    opt = engine.optimizer
    stage0 = {}
    if not engine.zero_optimization() and hasattr(opt, "fp32_groups"):  # the fp16/bf16 stage-0 optimizer
        for lp_group, fp_group in zip(opt.fp16_groups, opt.fp32_groups):
            stage0.update({id(lp): fp for lp, fp in zip(lp_group, fp_group)})
    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            full = safe_get_full_fp32_param(p)
            full = stage0.get(id(p), p) if full is None else full
            out[name] = full.detach().float().cpu().clone()
    return out


def train(engine, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        loss = engine(*rank_slice(batch(step), rank, world))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def run_case(rank: int, world: int, case: Case, out: str) -> None:
    torch.manual_seed(0)
    engine = engine_for(Net(), case.config())
    train(engine, range(SAVE_AT), rank, world)
    engine.save_checkpoint(out, client_state=dict(CLIENT))
    saved = scaler_fields(engine)
    del engine
    resume(rank, world, case, out, "reference.pt", saved)


def resume(rank: int, world: int, case: Case, out: str, name: str, saved: dict | None = None) -> None:
    """DeepSpeed's own resume of ``out`` on ``world`` ranks, recorded in ``out/name``."""
    torch.manual_seed(0)
    engine = engine_for(Net(), case.config(world=world))
    path, client = engine.load_checkpoint(out)
    assert path is not None and client["note"] == CLIENT["note"]
    losses = train(engine, range(SAVE_AT, SAVE_AT + RESUMED), rank, world)
    params = master_weights(engine)
    if rank == 0:
        torch.save({"world": world, "losses": losses, "params": params, "global_steps": engine.global_steps,
                    "skipped_steps": engine.skipped_steps, "loss_scale": scaler_fields(engine)["cur_scale"],
                    "saved_scaler": saved}, Path(out) / name)


def scaler_fields(engine) -> dict:
    """The loss scaler's state (the stage-0 fp16 optimizer keeps it in loss_scale_config, ZeRO in loss_scaler)."""
    opt = engine.optimizer
    scaler = getattr(opt, "loss_scale_config", None) or getattr(opt, "loss_scaler", None)
    fields = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    return {k: getattr(scaler, k, None) for k in fields}


def run_gpt2(rank: int, world: int, out: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(**GPT2)
    torch.manual_seed(0)
    ds_config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // world,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                 "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    engine = engine_for(GPT2LMHeadModel(config), ds_config)
    g = torch.Generator().manual_seed(7)
    for _ in range(SAVE_AT):
        tokens = torch.randint(0, GPT2["vocab_size"], (4, 6), generator=g)
        tokens = tokens[rank * (4 // world) : (rank + 1) * (4 // world)]
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out)
    params = master_weights(engine)
    if rank == 0:
        model = GPT2LMHeadModel(config).eval()
        model.load_state_dict(params, strict=False)  # lm_head.weight is tied to transformer.wte.weight
        with torch.no_grad():
            logits = model(GPT2_INPUT).logits
        config.save_pretrained(Path(out) / "hf_config")
        torch.save({"input_ids": GPT2_INPUT, "logits": logits, "params": params}, Path(out) / "reference.pt")


def main(only: list[str]) -> None:
    """Make every case, or only the cases named (the others are kept from the existing archive)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if only:
            extract(root)
            for name in only:
                shutil.rmtree(root / name, ignore_errors=True)
        for case in CASES:
            if only and case.name not in only:
                continue
            print(f"DeepSpeed {case.name}", file=sys.stderr)
            run_world(run_case, case.world, case, str(root / case.name), timeout=600)
            if case.stage == 0 and case in MATRIX:  # DeepSpeed itself resumes stage 0 at another world size
                other = 3 - case.world
                run_world(resume, other, case, str(root / case.name), f"reference_w{other}.pt", timeout=600)
        if not only or "gpt2" in only:
            print("DeepSpeed gpt2", file=sys.stderr)
            run_world(run_gpt2, 2, str(root / "gpt2"), timeout=600)
        for script in root.rglob("zero_to_fp32.py"):  # DeepSpeed copies its converter next to every save
            script.unlink()
        staging = FIXTURES.with_suffix(".tmp")
        with tarfile.open(staging, "w:xz", preset=9) as tar:
            for path in sorted(root.iterdir()):
                tar.add(path, arcname=path.name)
        staging.replace(FIXTURES)
        shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {FIXTURES} ({FIXTURES.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
