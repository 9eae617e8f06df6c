"""One rank of the README's Quickstart, as a user launches it (``dsfunc --num_gpus 2 quickstart_rank.py``): the
README's first snippet at the ZeRO stage given, fewer steps; then this rank's full parameters and world size go
to ``<out>/rank<r>.pt``."""

import argparse
import os
import re
from pathlib import Path

import torch

import dsfunc

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)  # the launcher's
args = parser.parse_args()

readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
code = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)[0]
for old, new in (('"stage": 3', f'"stage": {args.stage}'), ("range(1, 41)", "range(1, 5)")):
    assert old in code, old
    code = code.replace(old, new)
scope: dict = {}
exec(code, scope)  # noqa: S102 - the README is ours
state = scope["state"]
torch.save({"world": state.program.plan.world_size, "rank": torch.distributed.get_rank(),
            "params": dsfunc.full_params(state), "env_rank": int(os.environ["RANK"])},
           Path(args.out) / f"rank{os.environ['RANK']}.pt")
