"""Saving and loading on one process: layout, exact resume, async saves, argument errors."""

from __future__ import annotations

import json

import optree
import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.checkpoint.common import FP16, WARMUP, leaves_equal, trained
from tests.models import MLP, ConvBN, config, mlp_batches


def test_layout_metadata_latest_and_client_state(tmp_path):
    torch.manual_seed(0)
    batches = mlp_batches(3, 4)
    state = trained(MLP(), config(fp16=FP16, scheduler=WARMUP), batches, 3)
    path = dsfunc.checkpoint.save_checkpoint(state, tmp_path, client_state={"epoch": 3, "note": [1, 2]})
    assert path == str(tmp_path / "global_step3")
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "global_step3", "latest"]  # no temporary left
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
