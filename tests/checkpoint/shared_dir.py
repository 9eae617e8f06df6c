"""One of several jobs saving into one ``save_dir`` at once (``python -m tests.checkpoint.shared_dir ROOT JOB
SAVES``): each save alternates between a tag of its own and tags every job saves, and the job prints one
JSON line per save, ``[tag, "saved"]`` or ``[tag, error]``. The job's weights come from ``torch.manual_seed(JOB)``
and its client state says which job and which save wrote it, so a checker can tell whose a checkpoint is."""

from __future__ import annotations

import json
import sys

import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.models import MLP, config

SHARED = 3  # tags every job saves over


def model(job: int) -> MLP:
    torch.manual_seed(job)
    return MLP()


def tag_of(job: int, i: int) -> str:
    return f"job{job}_{i}" if i % 2 else f"shared{i % SHARED}"


def main() -> None:
    root, job, saves = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    state = dsfunc.init_state(model(job), config())
    for i in range(saves):
        tag = tag_of(job, i)
        try:
            ckpt.save_checkpoint(state, root, tag=tag, client_state={"job": job, "save": i})
            outcome = "saved"
        except ckpt.CheckpointError as e:
            outcome = f"{type(e).__name__}: {e}"
        print(json.dumps([tag, outcome]), flush=True)


if __name__ == "__main__":
    main()
