"""DeepSpeed checkpoints (ZeRO 0-3, 1 and 2 ranks, fp32/bf16/fp16) resumed by dsfunc at 1, 2 and 4 ranks and
every stage: the next steps equal DeepSpeed's own resume of the same checkpoint on the same data.

The DeepSpeed runs are the committed fixtures (``make_fixtures.py``); each dsfunc world size is one set of
processes that resumes every case it is given (:func:`stages`). Tolerances, relative:

* fp32: ``EXACT`` (1e-5) at every world size and stage.
* bf16 at the checkpoint's own world size: ``EXACT``, with dsfunc told to reduce gradients in bf16 as
  DeepSpeed does (dsfunc's default is fp32).
* fp16: ``ROUNDING`` (2e-3); at the checkpoint's own world size the measured difference is about 2e-5
  (the loss-scaled fp16 gradients of DeepSpeed's ZeRO and of dsfunc round differently).
* bf16/fp16 at another world size: DeepSpeed cannot resume ZeRO checkpoints there, so the reference is its
  resume at the checkpoint's world size, or at stage 0 its own resume on the other number of ranks; the
  gradients are summed over a different number of ranks and rounded to 16 bits differently:
  ``ROUNDING`` (2e-3).
* DeepSpeed's stage-0 fp16 optimizer (``fp16/unfused_optimizer.py``) does not take the Adam step its own
  saved state implies (an independent replication of that step from the checkpoint gives dsfunc's loss,
  not DeepSpeed's): for that case only the first resumed step, which the import alone decides, is compared.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dsfunc
from tests.checkpoint.deepspeed.common import (
    CASES,
    CLIENT,
    MATRIX,
    RESUMED,
    SAVE_AT,
    Case,
    Net,
    batch,
    rank_slice,
)
from tests.models import relative_diff
from tests.multiprocess import run_world

EXACT = 1e-5
ROUNDING = 2e-3
FIRST_STEP_ONLY = {"s0_w1_fp16"}


def stages(case: Case, world: int) -> list[int]:
    """The dsfunc stages ``case`` is resumed at on ``world`` ranks: one per world size, a Latin square.

    The matrix is ordered (precision, DeepSpeed world, DeepSpeed stage), so ``k = index // 4`` runs over its
    four (precision, world) variants. At every dsfunc world size each DeepSpeed stage meets every dsfunc
    stage (over k) and each dsfunc stage gets four cases; each case meets three dsfunc stages (one per
    world size). That covers the product without resuming every case 12 times.
    """
    k = CASES.index(case) // 4 if case in MATRIX else CASES.index(case)
    return [(case.stage + k + (1, 2, 4).index(world)) % 4]


def dsfunc_config(case: Case, world: int, stage: int) -> dict:
    """The DeepSpeed run's config at ``world`` and ``stage``, with DeepSpeed's effective 16-bit gradient
    communication made explicit (dsfunc reduces in fp32 unless told otherwise)."""
    cfg = case.config(world=world, stage=stage)
    if case.precision != "fp32":
        cfg["communication_data_type"] = case.precision
    return cfg


def resume_all(rank: int, world: int, root: str) -> dict:
    out = {}
    for case in CASES:
        for stage in stages(case, world):
            torch.manual_seed(1)  # other initial weights than DeepSpeed's: the checkpoint must replace them
            state = dsfunc.init_state(Net(), dsfunc_config(case, world, stage))
            state, client = dsfunc.load_checkpoint(f"{root}/{case.name}", state)
            loaded = {"step": int(state.step), "scaler": [x.item() for x in state.scaler[:4]],
                      "adam": int(state.opt_state["optimizer"]["adam"].count),
                      "lr_count": int(state.opt_state["optimizer"]["lr"].count)}
            losses = []
            for step in range(SAVE_AT, SAVE_AT + RESUMED):
                state = dsfunc.train_step(state, rank_slice(batch(step), rank, world))
                losses.append(state.metrics.loss.item())
            params = dsfunc.full_params(state)
            out[case.name, stage] = {"losses": losses, "params": params, "client": client, "loaded": loaded,
                                     "scale": state.scaler.scale.item(), "step": int(state.step)}
    return out if rank == 0 else {}


@functools.cache
def resumed(world: int, root: str) -> dict:
    return run_world(resume_all, world, root, timeout=600)[0]


def reference(root, case: Case, world: int) -> tuple[dict, float]:
    """DeepSpeed's resume to compare with, and the tolerance (see the module's docstring)."""
    own = torch.load(root / case.name / "reference.pt")
    if case.precision == "fp32" or (world == case.world and case.precision == "bf16"):
        return own, EXACT
    cross = root / case.name / f"reference_w{world}.pt"
    return (torch.load(cross) if cross.exists() else own), ROUNDING


def differences(r: dict, ref: dict, case: Case) -> tuple[float, float]:
    """Largest relative difference of the losses and of the fp32 master weights."""
    steps = 1 if case.name in FIRST_STEP_ONLY else RESUMED
    loss = max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:steps], ref["losses"][:steps]))
    if case.name in FIRST_STEP_ONLY:
        return loss, 0.0
    return loss, relative_diff({k: r["params"][k] for k in ref["params"]}, ref["params"])


def saved_as_is_or_16_bit(loaded: torch.Tensor, initial: torch.Tensor, precision: str) -> bool:
    """DeepSpeed keeps frozen parameters (and, in some layouts, buffers) in the 16-bit training dtype."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return torch.equal(loaded, initial) or torch.equal(loaded, initial.to(dtype).float())


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_resume_equals_deepspeeds_own_resume(ds_root, case, world):
    ref, tolerance = reference(ds_root, case, world)
    results = resumed(world, str(ds_root))
    for stage in stages(case, world):
        r = results[case.name, stage]
        where = f"DeepSpeed {case.name} -> dsfunc world {world} stage {stage}"
        applied = 0 if case.scale_power > 12 else SAVE_AT  # at 2**18 every step before the save overflowed
        assert r["loaded"]["step"] == SAVE_AT, where
        assert r["loaded"]["adam"] >= applied, where  # DeepSpeed's stage-0 16-bit optimizer steps once at init
        assert r["loaded"]["lr_count"] == applied, where  # WarmupLR's last_batch_iteration + 1
        loss, params = differences(r, ref, case)
        assert loss < tolerance and params < tolerance, f"{where}: loss {loss:.2e}, params {params:.2e}"
        assert r["step"] == ref["global_steps"], where
        assert torch.equal(r["params"]["head.weight"], r["params"]["emb.weight"]), where  # still tied
        for name in ("shift", "frozen"):  # the buffer and the frozen parameter, as DeepSpeed kept them
            assert saved_as_is_or_16_bit(r["params"][name], getattr(Net(), name), case.precision), where
        if case.precision == "fp16":
            saved = ref["saved_scaler"]
            hysteresis = saved["cur_hysteresis"] or 2  # the stage-0 optimizer keeps none: the config's
            assert r["loaded"]["scaler"] == [saved["cur_scale"], saved["cur_iter"], saved["last_overflow_iter"],
                                             hysteresis], where
            if case.name not in FIRST_STEP_ONLY:
                assert r["scale"] == ref["loss_scale"], where  # and went on as DeepSpeed's did
        assert r["client"].keys() == CLIENT.keys() and r["client"]["note"] == CLIENT["note"], where
        assert torch.equal(r["client"]["tensor"], CLIENT["tensor"]), where
