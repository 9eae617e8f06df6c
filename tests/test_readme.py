"""The README's code runs as written."""

import math
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_and_composition_snippets_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert len(blocks) >= 2
    scope: dict = {}
    torch.manual_seed(0)
    exec(blocks[0], scope)  # noqa: S102 - the README is ours
    assert int(scope["state"].step) == 40
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)$", capsys.readouterr().out, re.MULTILINE)]
    assert len(losses) == 4 and losses[-1] < math.log(256) - 1.5, losses  # trains visibly, well below chance
    tokens = torch.randint(0, 256, (16, 65))
    scope.update(loss_fn=lambda model, batch: model(*batch), batch=(tokens[:, :-1], tokens[:, 1:]))
    exec(blocks[1], scope)  # noqa: S102
    assert int(scope["state"].step) == 1
    assert scope["state"].metrics.lr.item() == 0.0  # WarmupLR's first step, from the transform's schedule
