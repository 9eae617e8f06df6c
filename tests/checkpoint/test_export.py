"""fp32 export, offline: the plain module loads it, the CLI's errors, one unit in memory at a time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import dsfunc
from dsfunc import checkpoint as ckpt
from dsfunc.cli import export as cli_export
from tests.checkpoint.common import Tied, tied_batches, trained
from tests.models import MLP, config


def test_export_loads_into_the_plain_module_with_tied_names_and_buffers(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    state = trained(model, config(), tied_batches(3), 3)
    ckpt.save_checkpoint(state, tmp_path / "ck")
    assert cli_export([str(tmp_path / "ck"), str(tmp_path / "w.safetensors")]) == 0
    assert cli_export([str(tmp_path / "ck" / "global_step3"), str(tmp_path / "w.bin"),
                        "--format", "pt"]) == 0
    assert ckpt.export_fp32(tmp_path / "ck", tmp_path / "w.pt", tag="global_step3") == str(tmp_path / "w.pt")
    x = tied_batches(1)[0][0]
    reference = Tied()
    reference.load_state_dict(dsfunc.full_params(state))
    expected = reference.eval()(x)
    names = list(Tied().state_dict())
    for sd in (safetensors.torch.load_file(tmp_path / "w.safetensors"), torch.load(tmp_path / "w.bin"),
               torch.load(tmp_path / "w.pt", weights_only=True)):
        assert sorted(sd) == sorted(names)
        assert "head.weight" in sd and "norm.running_var" in sd and "scale" in sd
        assert all(v.dtype == (torch.int64 if k.endswith("num_batches_tracked") else torch.float32)
                   for k, v in sd.items())
        plain = Tied()
        plain.load_state_dict(sd)  # strict
        assert torch.equal(plain.eval()(x), expected)
    pt = torch.load(tmp_path / "w.pt")
    assert list(pt) == names
    assert pt["head.weight"].data_ptr() == pt["emb.weight"].data_ptr()  # tied names share one tensor
    assert not list(tmp_path.glob("w.*.tmp-*")) and not list(tmp_path.glob("*staging*"))


def test_export_cli_errors(tmp_path, capsys):
    ckpt.save_checkpoint(dsfunc.init_state(MLP(), config()), tmp_path, tag="only")
    assert cli_export([str(tmp_path), str(tmp_path / "w.npz")]) == 1
    assert "name it *.safetensors or *.pt" in capsys.readouterr().err
    assert cli_export([str(tmp_path), str(tmp_path / "w.pt"), "--tag", "nope"]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint tagged 'nope'" in err and "'only'" in err
    assert not (tmp_path / "w.pt").exists()


EXPORT_RSS = """
import sys
from dsfunc import checkpoint

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

checkpoint.export_fp32(sys.argv[1], sys.argv[2] + ".warmup.safetensors", tag="tiny")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident set size (VmHWM)
before = status("VmRSS")
checkpoint.export_fp32(sys.argv[1], sys.argv[2], tag="big")
print(status("VmHWM") - before)
"""


class Deep(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_export_holds_one_unit_at_a_time(tmp_path):
    width, depth = 512, 32  # 33.6 MB of fp32 weights in 32 units of 1 MB
    cfg = config(micro=2, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    ckpt.save_checkpoint(dsfunc.init_state(Deep(8, 2), cfg), tmp_path, tag="tiny")
    ckpt.save_checkpoint(dsfunc.init_state(Deep(width, depth), cfg), tmp_path, tag="big")
    out = tmp_path / "big.safetensors"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-c", EXPORT_RSS, str(tmp_path), str(out)], check=False, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    grew = int(run.stdout.split()[-1])
    weights = depth * (width * width + width) * 4
    assert out.stat().st_size > weights
    assert grew < weights / 3, f"peak memory grew {grew / 2**20:.1f} MiB exporting {weights / 2**20:.1f} MiB"
