"""Client optimizers and lr schedulers under real DeepSpeed 0.19.8 (CPU, gloo, 2 ranks) and under dsfunc: a custom
``torch.optim.Optimizer`` subclass, RMSprop and Adam(amsgrad) run their own ``step()`` (dsfunc on its fp32 shards),
an empty param group is dropped, ``initialize`` returns the client's objects as DeepSpeed does, the engine steps the
client's scheduler, and ``was_step_applied()`` answers as DeepSpeed's on and off the accumulation boundary."""

from __future__ import annotations

import pytest
import torch

from tests.deepspeed.test_against_deepspeed import ROOT, launch

SCRIPT = f"{ROOT}/tests/deepspeed/scripts/ds_client_objects.py"


def test_client_optimizer_and_scheduler_as_deepspeed(tmp_path):
    pytest.importorskip("deepspeed", reason="real DeepSpeed is the reference (.ci/setup_test_tools.sh)")
    out = str(tmp_path / "run")
    launch("deepspeed", out, script=SCRIPT)
    launch("dsfunc", out, script=SCRIPT)
    for rank in range(2):
        ds, ours = (torch.load(f"{out}.{b}.rank{rank}.pt") for b in ("deepspeed", "dsfunc"))
        assert ds.pop("untested_refused") and ours.pop("untested_refused")
        assert sorted(ours, key=str) == sorted(ds, key=str)
        for case, expected in ds.items():
            got = ours[case]
            for key in ("optimizer_is_client", "wraps_client", "scheduler_is_client", "engine_scheduler_is_client",
                        "groups", "applied", "lr"):
                assert got[key] == expected[key], (rank, case, key)
            for name, value in expected["params"].items():
                assert (got["params"][name] - value).abs().max() / value.abs().max() < 1e-6, (rank, case, name)
