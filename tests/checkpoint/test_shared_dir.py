"""Several jobs saving into one ``save_dir`` at once, as real processes: no save tears another job's, every
save that returned loads whole, and what crashed saves leave is tidied only once their owner is dead."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.checkpoint import shared_dir
from tests.models import MLP, config

ROOT = Path(__file__).resolve().parents[2]
JOBS, SAVES = 3, 40


def _job(root: Path, job: int, saves: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.checkpoint.shared_dir", str(root), str(job), str(saves)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _loads_whole(root: Path, tag: str | None) -> dict:
    """Load ``tag`` and check that its weights are those of the job its client state names."""
    state, client = ckpt.load_checkpoint(root, dsfunc.init_state(MLP(), config()), tag=tag)
    expected = dsfunc.full_params(dsfunc.init_state(shared_dir.model(client["job"]), config()))
    got = dsfunc.full_params(state)
    assert all(torch.equal(got[k], expected[k]) for k in expected), f"{tag}: a mix of jobs' files"
    return client


def test_three_jobs_saving_into_one_save_dir_at_once(tmp_path):
    jobs = [_job(tmp_path, job, SAVES) for job in range(JOBS)]
    outcomes = {}
    for job, proc in enumerate(jobs):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        outcomes[job] = [json.loads(line) for line in out.splitlines()]
    failed = [(job, tag, outcome) for job, lines in outcomes.items() for tag, outcome in lines if outcome != "saved"]
    assert failed == [], failed[:3]
    for job, lines in outcomes.items():
        assert len(lines) == SAVES
        for i, (tag, _) in enumerate(lines):
            client = _loads_whole(tmp_path, tag)
            if tag.startswith("job"):  # its own tag: exactly what this save wrote
                assert client == {"job": job, "save": i}
    _loads_whole(tmp_path, None)  # `latest` names a whole checkpoint
    left = {p.name for p in tmp_path.iterdir()} - set(ckpt.available_tags(tmp_path))
    assert left == {".lock", "latest"}, "no temporary or replaced folder is left"



def test_a_job_killed_at_a_random_moment_leaves_the_others_saves_whole(tmp_path):
    """Kill-safety with jobs sharing the folder: one job is SIGKILLed somewhere in its saves (maybe holding
    the lock of save_dir, maybe mid-publish); the others go on, every save that returned loads, and the next
    save tidies what the killed one left."""
    jobs = [_job(tmp_path, job, SAVES // 2) for job in range(JOBS)]
    victim = jobs[-1]
    while not any(tmp_path.glob("job2_*")):  # it has published at least once
        assert victim.poll() is None, victim.stderr.read()
    time.sleep(random.uniform(0, 1))
    victim.kill()
    saved = []
    for proc in jobs:
        out, err = proc.communicate(timeout=600)
        assert proc is victim or proc.returncode == 0, err
        lines = out.split("\n")[:-1]  # a killed job's last line may be cut short
        saved += [tag for tag, outcome in map(json.loads, lines) if outcome == "saved"]
    for tag in saved:
        _loads_whole(tmp_path, tag)
    _loads_whole(tmp_path, None)
    ckpt.save_checkpoint(dsfunc.init_state(MLP(), config()), tmp_path, tag="after")
    left = {p.name for p in tmp_path.iterdir()} - set(ckpt.available_tags(tmp_path))
    assert left == {".lock", "latest"}, left

# a save stopped after claiming its temporary folder, before publishing it (as while its ranks write)
IN_PROGRESS = """
import sys, time
from pathlib import Path
from dsfunc.checkpoint.publish import _temporary
with _temporary(Path(sys.argv[1]), "slow", 60) as tmp:
    print(tmp, flush=True)
    time.sleep(600)
"""


def test_a_save_in_progress_is_left_alone_and_a_dead_ones_is_tidied(tmp_path):
    state = dsfunc.init_state(MLP(), config())
    ckpt.save_checkpoint(state, tmp_path, tag="first")
    (tmp_path / ".old.tmp-0123456789ab").mkdir()  # a save that died before claiming its folder
    job = subprocess.Popen([sys.executable, "-c", IN_PROGRESS, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        tmp = Path(job.stdout.readline().strip())
        assert tmp.parent == tmp_path and tmp.is_dir()
        assert not (tmp_path / ".old.tmp-0123456789ab").exists()  # its save tidied the dead one's
        for tag in ("first", "second", "slow"):  # over a tag, a new tag, the tag it is saving
            ckpt.save_checkpoint(state, tmp_path, tag=tag)
            assert tmp.is_dir(), "another job's save in progress was removed"
    finally:
        job.kill()
        job.communicate()
    ckpt.save_checkpoint(state, tmp_path, tag="after")
    assert not tmp.exists(), "what the killed save left is tidied by the next save"
    assert ckpt.available_tags(tmp_path) == ["first", "second", "slow", "after"]


HOLDER = """
import sys, time
from pathlib import Path
from dsfunc.checkpoint.locks import hold
with hold(Path(sys.argv[1]), 5):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_job_stopped_while_it_holds_the_lock_is_named_after_the_timeout(tmp_path):
    """The lock of save_dir held by another process (a job stopped mid-publish): a save waits ``timeout``
    seconds, then says who holds it; nothing is changed."""
    state = dsfunc.init_state(MLP(), config())
    ckpt.save_checkpoint(state, tmp_path, tag="first")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ckpt.CheckpointTimeoutError,
                           match=rf"process {holder.pid} on \S+ has held {tmp_path}/.lock for over 1 s: another "
                                 r"job is saving into the same save_dir .* Nothing was replaced: `latest` still names"):
            ckpt.save_checkpoint(state, tmp_path, tag="second", timeout=1)
    finally:
        holder.kill()
        holder.communicate()
    assert ckpt.available_tags(tmp_path) == ["first"] and not list(tmp_path.glob(".*.tmp-*"))
    ckpt.save_checkpoint(state, tmp_path, tag="second")  # the lock died with its holder
