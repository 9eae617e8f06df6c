"""Checkpoints on one process: layout, exact resume, errors that name the problem, fp32 export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optree
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import dsfunc
from dsfunc import checkpoint as ckpt
from dsfunc.checkpoint import export
from tests.models import MLP, ConvBN, config, mlp_batches

FP16 = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2, "hysteresis": 2}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 6}}


class Tied(nn.Module):
    """Tied embedding and head, BatchNorm buffers, a frozen parameter, blocks in a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.norm = nn.BatchNorm1d(6)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6), requires_grad=False)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(x).mean(1)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(self.norm(h) * self.scale)
        return logits if y is None else F.cross_entropy(logits.float(), y)


def tied_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 11, (4, 3), generator=g), torch.randint(0, 11, (4,), generator=g))
            for _ in range(steps)]


def leaves_equal(a: dsfunc.TrainState, b: dsfunc.TrainState) -> bool:
    xs, ys = optree.tree_leaves(a), optree.tree_leaves(b)
    return len(xs) == len(ys) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(xs, ys))


def trained(model: nn.Module, cfg: dict, batches: list, steps: int, seed: int = 0) -> dsfunc.TrainState:
    state = dsfunc.init_state(model, cfg, seed=seed)
    for i in range(steps):
        state = dsfunc.train_step(state, batches[i])
    return state


def test_layout_metadata_latest_and_client_state(tmp_path):
    torch.manual_seed(0)
    batches = mlp_batches(3, 4)
    state = trained(MLP(), config(fp16=FP16, scheduler=WARMUP), batches, 3)
    path = dsfunc.checkpoint.save_checkpoint(state, tmp_path, client_state={"epoch": 3, "note": [1, 2]})
    assert path == str(tmp_path / "global_step3")
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "latest"]  # no temporary left
    meta = json.loads((tmp_path / "global_step3" / ckpt.META_FILE).read_text())
    assert (meta["step"], meta["world_size"], meta["zero_stage"], meta["precision"]) == (3, 1, 0, "fp16")
    assert meta["torch_version"] == torch.__version__ and meta["dsfunc_version"] == dsfunc.__version__
    assert meta["optimizer"] == "adamw" and meta["config"]["fp16"]["initial_scale_power"] == 20
    shapes = {p["name"]: p["shape"] for u in meta["units"] for p in u["params"]}
    assert shapes == {k: list(v.shape) for k, v in MLP().state_dict().items()}
    on_disk = {p.name for p in (tmp_path / "global_step3").iterdir()} - {ckpt.META_FILE}
    assert set(meta["files"]) == on_disk and all(len(f["sha256"]) == 64 for f in meta["files"].values())
    assert meta["tensors"]["optim/optimizer/adam/mu/root"] == {"unit": "root", "shape": [92],
                                                                "dtype": "float32"}

    # save_latest=False leaves `latest`; an explicit tag is used as the folder name
    state = dsfunc.train_step(state, batches[0])
    assert ckpt.save_checkpoint(state, str(tmp_path), tag="manual", save_latest=False).endswith("manual")
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert ckpt.available_tags(tmp_path) == ["global_step3", "manual"]

    template = dsfunc.init_state(MLP(), config(fp16=FP16, scheduler=WARMUP))
    loaded, client = ckpt.load_checkpoint(tmp_path, template)
    assert client == {"epoch": 3, "note": [1, 2]} and int(loaded.step) == 3
    loaded, client = ckpt.load_checkpoint(tmp_path, loaded, tag="manual")  # a used state is a template too
    assert client == {} and int(loaded.step) == 4 and leaves_equal(loaded, state)


def test_exact_resume_with_batchnorm_fp16_scaler_and_schedule(tmp_path):
    torch.manual_seed(0)
    model = ConvBN()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 5, 5, generator=g) * 3, torch.randint(0, 3, (4,), generator=g))
               for _ in range(8)]
    cfg = config(fp16=FP16, scheduler=WARMUP)
    state = trained(model, cfg, batches, 4, seed=3)
    ckpt.save_checkpoint(state, tmp_path)
    for i in range(4, 8):
        state = dsfunc.train_step(state, batches[i])
    assert state.metrics.skipped.item() == 0 and float(state.scaler.scale) < 2.0**20  # overflowed, recovered

    template = dsfunc.init_state(model, cfg, seed=0)  # another seed: the checkpoint's must win
    resumed, _ = ckpt.load_checkpoint(tmp_path, template)
    with pytest.raises(dsfunc.DonatedStateError):
        template.params  # noqa: B018
    for i in range(int(resumed.step), 8):
        resumed = dsfunc.train_step(resumed, batches[i])
    assert leaves_equal(resumed, state)


def test_async_save_lets_training_continue(tmp_path):
    torch.manual_seed(0)
    batches = mlp_batches(6, 4)
    state = trained(MLP(), config(), batches, 2)
    reference = optree.tree_map(torch.clone, state)
    path = ckpt.save_checkpoint(state, tmp_path, async_save=True)
    for i in range(2, 6):
        state = dsfunc.train_step(state, batches[i])  # overwrites the buffers the save was taken from
    assert ckpt.wait_for_checkpoint() == path and ckpt.wait_for_checkpoint() is None
    loaded, _ = ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), config()))
    assert leaves_equal(loaded, reference)


def test_no_checkpoint_or_missing_tag_lists_what_exists(tmp_path):
    template = dsfunc.init_state(MLP(), config())
    with pytest.raises(ckpt.CheckpointNotFoundError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "nowhere", template)
    with pytest.raises(ckpt.CheckpointNotFoundError,
                       match=r"no `latest` file .* pass tag=.*no complete checkpoint"):
        ckpt.load_checkpoint(tmp_path, template)
    ckpt.save_checkpoint(template, tmp_path, tag="a", save_latest=False)
    ckpt.save_checkpoint(template, tmp_path, tag="b", save_latest=False)
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"no `latest`.*checkpoints there: 'a', 'b'"):
        ckpt.load_checkpoint(tmp_path, template)
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"no checkpoint tagged 'c' in .*'a', 'b'"):
        ckpt.load_checkpoint(tmp_path, template, tag="c")
    (tmp_path / "latest").write_text("gone")
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"tagged 'gone' \(named by .*latest\)"):
        ckpt.load_checkpoint(tmp_path, template)
    assert not template.donated  # nothing was read into it


def test_partial_and_foreign_folders_are_never_checkpoints(tmp_path):
    template = dsfunc.init_state(MLP(), config())
    ckpt.save_checkpoint(template, tmp_path, tag="good")
    (tmp_path / ".half.tmp-123").mkdir()  # what a crashed save leaves
    (tmp_path / ".half.tmp-123" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert ckpt.available_tags(tmp_path) == ["good"]
    with pytest.raises(ckpt.CheckpointNotFoundError,
                       match=r"half is not a complete dsfunc checkpoint.*'good'"):
        ckpt.load_checkpoint(tmp_path, template, tag="half")
    with pytest.raises(ckpt.CheckpointNotFoundError, match="looks like a DeepSpeed checkpoint"):
        ckpt.load_checkpoint(tmp_path, template, tag="deepspeed")
    ckpt.save_checkpoint(template, tmp_path, tag="next")  # tidies what crashed saves left
    assert not (tmp_path / ".half.tmp-123").exists()


def test_damaged_files_are_named_and_earlier_checkpoints_still_load(tmp_path):
    torch.manual_seed(0)
    batches = mlp_batches(2, 4)
    state = trained(MLP(), config(), batches, 1)
    ckpt.save_checkpoint(state, tmp_path)
    state = dsfunc.train_step(state, batches[1])
    ckpt.save_checkpoint(state, tmp_path)
    shard = tmp_path / "global_step2" / "__0_0.distcp"
    data = shard.read_bytes()
    template = dsfunc.init_state(MLP(), config())

    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointCorruptError,
                       match=rf"__0_0.distcp is {len(data) // 2} bytes but {len(data)} were written "
                             r"\(truncated\)"
                             r".*load an earlier checkpoint with tag=... \('global_step1'\)"):
        ckpt.load_checkpoint(tmp_path, template)
    shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(ckpt.CheckpointCorruptError, match="__0_0.distcp does not match the sha256"):
        ckpt.load_checkpoint(tmp_path, template)
    shard.unlink()
    with pytest.raises(ckpt.CheckpointCorruptError, match="__0_0.distcp is missing"):
        ckpt.load_checkpoint(tmp_path, template)
    (tmp_path / "global_step2" / ckpt.META_FILE).write_text("{not json")
    with pytest.raises(ckpt.CheckpointCorruptError, match="cannot read .*dsfunc_checkpoint.json"):
        ckpt.load_checkpoint(tmp_path, template)
    assert not template.donated
    loaded, _ = ckpt.load_checkpoint(tmp_path, template, tag="global_step1")
    assert int(loaded.step) == 1


def test_model_mismatch_lists_parameters(tmp_path):
    ckpt.save_checkpoint(dsfunc.init_state(MLP(width=8, depth=3), config()), tmp_path)
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(width=10, depth=2), config()))
    message = str(info.value)
    assert "in the checkpoint but not in the model: blocks.2.0.bias, blocks.2.0.weight" in message
    assert "inp.weight (checkpoint (8, 6), the model (10, 6))" in message
    assert "Build the template state from the model the checkpoint was saved from" in message
    with pytest.raises(ckpt.CheckpointMismatchError,
                       match=r"in the model but not in the checkpoint: .*\(buffer\)"):
        ckpt.load_checkpoint(tmp_path, dsfunc.init_state(Tied(), config()))
    other_units = dsfunc.init_state(MLP(), config(), unit_modules=["blocks.0"])
    with pytest.raises(ckpt.CheckpointMismatchError,
                       match=r"into units \['root', 'blocks.0', .*unit_modules"):
        ckpt.load_checkpoint(tmp_path, other_units)


def test_entries_the_checkpoint_lacks_are_named_before_the_template_is_touched(tmp_path):
    ckpt.save_checkpoint(dsfunc.init_state(MLP(), config()), tmp_path)
    meta_file = tmp_path / "global_step0" / ckpt.META_FILE
    meta = json.loads(meta_file.read_text())
    del meta["tensors"]["metrics/lr"]  # as if saved by a dsfunc that did not record this metric yet
    meta_file.write_text(json.dumps(meta))
    loaded, _ = ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), config()))  # metrics are optional
    assert int(loaded.step) == 0
    del meta["tensors"]["rng"]
    meta_file.write_text(json.dumps(meta))
    template = dsfunc.init_state(MLP(), config())
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"has no rng, which this state needs"):
        ckpt.load_checkpoint(tmp_path, template)
    assert not template.donated


def test_another_optimizer_is_named_and_can_start_fresh(tmp_path):
    torch.manual_seed(0)
    state = trained(MLP(), config(), mlp_batches(2, 4), 2)
    full = dsfunc.full_params(state)
    ckpt.save_checkpoint(state, tmp_path)
    sgd = config(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    with pytest.raises(ckpt.CheckpointMismatchError,
                       match=r"optimizer 'adamw'\) does not fit this state's optimizer \('sgd'\)(.|\n)*"
                             r"in the checkpoint but not in this state's optimizer: optimizer/adam/count"
                             r"(.|\n)*load_optimizer_states=False"):
        ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), sgd))
    loaded, _ = ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), sgd), load_optimizer_states=False)
    assert int(loaded.step) == 2
    assert all(torch.equal(full[k], v) for k, v in dsfunc.full_params(loaded).items())
    loaded = dsfunc.train_step(loaded, mlp_batches(1, 4)[0])
    assert torch.isfinite(loaded.metrics.loss)


def test_precision_changes_keep_masters_and_reset_an_incompatible_scaler(tmp_path):
    torch.manual_seed(0)
    state = trained(MLP(), config(fp16=FP16), mlp_batches(3, 4), 3)
    ckpt.save_checkpoint(state, tmp_path)
    full, scale = dsfunc.full_params(state), float(state.scaler.scale)
    assert scale != 2.0**20
    for target in ({}, {"bf16": {"enabled": True}}, {"fp16": {**FP16, "initial_scale_power": 10}}):
        template = dsfunc.init_state(MLP(), config(**target))
        fresh_scale = float(template.scaler.scale)
        loaded, _ = ckpt.load_checkpoint(tmp_path, template)
        assert all(torch.equal(full[k], v) for k, v in dsfunc.full_params(loaded).items())
        expected = scale if "fp16" in target else fresh_scale  # same precision and scaler kind: resumed
        assert float(loaded.scaler.scale) == expected
        mu = loaded.opt_state["optimizer"]["adam"].mu["root"]
        assert torch.equal(mu, state.opt_state["optimizer"]["adam"].mu["root"])


def test_overwriting_a_tag_and_a_crash_between_the_renames(tmp_path):
    torch.manual_seed(0)
    batches = mlp_batches(2, 4)
    state = trained(MLP(), config(), batches, 1)
    ckpt.save_checkpoint(state, tmp_path, tag="t")
    state = dsfunc.train_step(state, batches[1])
    ckpt.save_checkpoint(state, tmp_path, tag="t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t"]
    loaded, _ = ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), config()))
    assert int(loaded.step) == 2

    # the state a crash leaves after the old folder was moved aside and before the new one moved in
    os.rename(tmp_path / "t", tmp_path / ".t.replaced")
    loaded, _ = ckpt.load_checkpoint(tmp_path, dsfunc.init_state(MLP(), config()))
    assert int(loaded.step) == 2
    ckpt.save_checkpoint(loaded, tmp_path, tag="other")  # the next save puts it back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "other", "t"]


def test_bad_arguments(tmp_path):
    state = dsfunc.init_state(MLP(), config())
    with pytest.raises(ValueError, match="save_dir is empty"):
        ckpt.save_checkpoint(state, "")
    for tag in ("", ".hidden", "a/b", "latest"):
        with pytest.raises(ValueError, match="invalid checkpoint tag"):
            ckpt.save_checkpoint(state, tmp_path, tag=tag)
    with pytest.raises(TypeError, match="expects a TrainState"):
        ckpt.save_checkpoint({"params": 1}, tmp_path)
    dsfunc.train_step(state, mlp_batches(1, 4)[0])
    with pytest.raises(dsfunc.DonatedStateError):
        ckpt.save_checkpoint(state, tmp_path)
    assert not any(tmp_path.iterdir())


def test_export_loads_into_the_plain_module_with_tied_names_and_buffers(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    state = trained(model, config(), tied_batches(3), 3)
    ckpt.save_checkpoint(state, tmp_path / "ck")
    assert export.main([str(tmp_path / "ck"), str(tmp_path / "w.safetensors")]) == 0
    assert export.main([str(tmp_path / "ck" / "global_step3"), str(tmp_path / "w.bin"),
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
    assert export.main([str(tmp_path), str(tmp_path / "w.npz")]) == 1
    assert "name it *.safetensors or *.pt" in capsys.readouterr().err
    assert export.main([str(tmp_path), str(tmp_path / "w.pt"), "--tag", "nope"]) == 1
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
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-c", EXPORT_RSS, str(tmp_path), str(out)], check=False, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    grew = int(run.stdout.split()[-1])
    weights = depth * (width * width + width) * 4
    assert out.stat().st_size > weights
    assert grew < weights / 3, f"peak memory grew {grew / 2**20:.1f} MiB exporting {weights / 2**20:.1f} MiB"
