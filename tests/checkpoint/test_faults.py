"""Faults during a checkpoint, with real processes: a rank killed (SIGKILL, or by the kernel part-way
through a write), a filesystem that refuses writes part-way, and ranks that do not make the same call.
Each ends with a clear error, and no earlier checkpoint or ``latest`` is lost."""

from __future__ import annotations

import os
import re
import resource
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.checkpoint.ranks import run_ranks
from tests.models import MLP, config, mlp_batches
from tests.multiprocess import run_world

BATCHES = mlp_batches(3, 8)


def trained(rank: int, world: int, steps: int, stage: int = 2) -> dsfunc.TrainState:
    torch.manual_seed(0)
    state = dsfunc.init_state(MLP(), config(micro=8 // world, world=world, stage=stage))
    for i in range(steps):
        x, y = BATCHES[i]
        n = 8 // world
        state = dsfunc.train_step(state, (x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]))
    return state


def die_after_writing() -> None:
    """This rank writes its tensor file, then is killed with SIGKILL (before the save completes)."""
    write = dcp.FileSystemWriter.write_data

    def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
        write(self, plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)

    dcp.FileSystemWriter.write_data = write_then_die


def limit_file_size(fatal: bool) -> None:
    """Files this process writes may not grow past 1 KiB: the kernel kills it with SIGXFSZ part-way through
    the write (``fatal``), or the write fails with EFBIG."""
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL if fatal else signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def save_then_fault(rank: int, world: int, root: str, victim: int, fault: str, tag: str | None) -> Any:
    state = trained(rank, world, 1)
    ckpt.save_checkpoint(state, root)
    first = dsfunc.full_params(state)
    state = trained(rank, world, 2)
    if rank == victim:
        die_after_writing() if fault == "kill" else limit_file_size(fatal=True)
    try:
        ckpt.save_checkpoint(state, root, tag=tag)
    except ckpt.CheckpointError as e:
        return first, str(e)
    return first, "saved"


def check_previous_checkpoint_survives(root: Path, first: dict[str, torch.Tensor]) -> None:
    assert (root / "latest").read_text() == "global_step1"
    state, _ = ckpt.load_checkpoint(root, dsfunc.init_state(MLP(), config(micro=8)))
    assert int(state.step) == 1
    assert all(torch.equal(v, first[k]) for k, v in dsfunc.full_params(state).items())


def test_rank_killed_after_writing_its_shard(tmp_path):
    (code0, (first, message)), (code1, _) = run_ranks(save_then_fault, 2, str(tmp_path), 1, "kill", None)
    assert (code0, code1) == (0, -signal.SIGKILL)
    assert "saving checkpoint 'global_step2'" in message and "failed" in message
    assert "`latest` still names 'global_step1'" in message
    assert ckpt.available_tags(tmp_path) == ["global_step1"]
    assert not list(tmp_path.glob(".*tmp*"))  # rank 0 removed the half-written folder
    check_previous_checkpoint_survives(tmp_path, first)


def test_coordinator_killed_mid_write_while_overwriting_the_tag(tmp_path):
    (code0, _), (code1, (first, message)) = run_ranks(
        save_then_fault, 2, str(tmp_path), 0, "fsize", "global_step1")
    assert (code0, code1) == (-signal.SIGXFSZ, 0)
    assert "saving checkpoint 'global_step1'" in message and "failed" in message
    (partial,) = tmp_path.glob(".global_step1.tmp-*")  # what rank 0 was writing when it died
    assert (partial / "__0_0.distcp").stat().st_size == 1024
    assert ckpt.available_tags(tmp_path) == ["global_step1"]
    check_previous_checkpoint_survives(tmp_path, first)  # the tag it was replacing is intact
    ckpt.save_checkpoint(dsfunc.init_state(MLP(), config(micro=8)), tmp_path, tag="later")
    assert not partial.exists()


def alive_faults(rank: int, world: int, root: str) -> dict[str, Any]:
    """Faults every rank survives, one after the other in the same process group."""
    seen: dict[str, Any] = {}
    state = trained(rank, world, 1)
    ckpt.save_checkpoint(state, root)
    seen["first"] = dsfunc.full_params(state)

    # the filesystem refuses rank 1's writes part-way, while saving over global_step1 and a new tag
    state = trained(rank, world, 2)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        limit_file_size(fatal=False)
    for tag in ("global_step1", None):
        try:
            ckpt.save_checkpoint(state, root, tag=tag, timeout=30)
            seen[f"disk full {tag}"] = "saved"
        except ckpt.CheckpointError as e:
            seen[f"disk full {tag}"] = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    loaded, _ = ckpt.load_checkpoint(root, trained(rank, world, 0), timeout=30)
    seen["after disk full"] = int(loaded.step)

    # rank 0 saves alone: it gets an error in time; rank 1 arrives late and gets one too
    if rank == 1:
        time.sleep(4)
    try:
        ckpt.save_checkpoint(state, root, tag="lonely", timeout=2)
        seen["alone"] = "saved"
    except ckpt.CheckpointTimeoutError as e:
        seen["alone"] = str(e)

    # different calls (different tags: test_tag_validation.py)
    try:
        if rank == 0:
            ckpt.save_checkpoint(state, root, tag="x", timeout=30)
        else:
            ckpt.load_checkpoint(root, state, tag="x", timeout=30)
        seen["save/load"] = "no error"
    except ckpt.CheckpointError as e:
        seen["save/load"] = str(e)

    # rank 0 loads alone (the template stays usable); rank 1 calls too late
    if rank == 1:
        time.sleep(3)
    try:
        ckpt.load_checkpoint(root, state, timeout=1)
        seen["load alone"] = "loaded"
    except ckpt.CheckpointTimeoutError as e:
        seen["load alone"] = (str(e), state.donated)

    # everyone agrees again: it works
    seen["recovered"] = ckpt.save_checkpoint(state, root, timeout=30)
    loaded, _ = ckpt.load_checkpoint(root, trained(rank, world, 0), tag="global_step2", timeout=30)
    seen["recovered step"] = int(loaded.step)
    return seen


def test_faults_every_rank_survives(tmp_path):
    seen = run_world(alive_faults, 2, str(tmp_path), timeout=120)
    for rank in range(2):
        for tag in ("global_step1", "global_step2"):
            message = seen[rank][f"disk full {None if tag == 'global_step2' else tag}"]
            assert f"saving checkpoint {tag!r}" in message
            assert re.search(r"rank 1: file too large for this process's file-size limit \(ulimit -f\) while "
                             r"writing \S+/\.global_step\d\.tmp-\w+/__1_0\.distcp \(raise the limit", message), message
            assert "`latest` still names 'global_step1'" in message
            assert "earlier checkpoints are intact" in message
        assert seen[rank]["after disk full"] == 1
        assert "rank 0: save_checkpoint(tag='x'); rank 1: load_checkpoint(tag='x')" in seen[rank]["save/load"]
        assert seen[rank]["recovered"] == str(tmp_path / "global_step2") and seen[rank]["recovered step"] == 2

    message = seen[0]["alone"]  # it came at all: no hang (run_world's timeout bounds the whole run)
    assert "save_checkpoint(tag='lonely') waited 2 s for rank(s) 1 of 2, which did not call it" in message
    assert "`if rank == 0:`" in message and "timeout=" in message
    late = seen[1]["alone"]
    assert ("rank 0 called save_checkpoint(tag='lonely') and gave up after 2 s waiting for rank(s) 1 of 2; "
            "this rank's save_checkpoint(tag='lonely') came too late") in late
    message, donated = seen[0]["load alone"]
    assert "load_checkpoint(tag=None) waited 1 s for rank(s) 1 of 2" in message and not donated
    assert "this rank's load_checkpoint(tag=None) came too late" in seen[1]["load alone"][0]
    assert ckpt.available_tags(tmp_path) == ["global_step1", "global_step2"]
    state, _ = ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), config(micro=8)), tag="global_step1")
    assert all(torch.equal(v, seen[0]["first"][k]) for k, v in dsfunc.full_params(state).items())
