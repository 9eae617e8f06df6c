"""``dsfunc export --hf-config``: a dsfunc checkpoint of a Hugging Face model as a directory
``from_pretrained`` loads, sharded at a size limit, with the trained model's logits exactly."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import dsfunc
from dsfunc.checkpoint import hf
from dsfunc.cli import export as cli_export
from tests.checkpoint.deepspeed.common import GPT2, GPT2_INPUT


def gpt2_batches(steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, GPT2["vocab_size"], (4, 6), generator=g) for _ in range(steps)]
    return [{"input_ids": t, "labels": t} for t in tokens]


def test_a_dsfunc_gpt2_checkpoint_loads_with_from_pretrained_and_gives_its_logits(tmp_path):
    config = GPT2Config(**GPT2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    state = dsfunc.init_state(model, cfg)
    for batch in gpt2_batches(3):
        state = dsfunc.train_step(state, batch)
    dsfunc.save_checkpoint(state, tmp_path / "ckpt")
    config.save_pretrained(tmp_path / "config")
    assert cli_export([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf-config", str(tmp_path / "config"),
                        "--max-shard-size", "3KB"]) == 0

    index = json.loads((tmp_path / "hf" / hf.INDEX_FILE).read_text())
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied to transformer.wte.weight, as save_pretrained does
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    trained = GPT2LMHeadModel(config)
    trained.load_state_dict(dsfunc.full_params(state))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(GPT2_INPUT).logits, trained.eval()(GPT2_INPUT).logits)

    assert hf.export_hf(tmp_path / "ckpt", tmp_path / "one", tmp_path / "config") == str(tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json", "model.safetensors",
                                                                   hf.INDEX_FILE]


def test_export_hf_refuses_what_it_cannot_write(tmp_path, capsys):
    state = dsfunc.init_state(GPT2LMHeadModel(GPT2Config(**GPT2)),
                              {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD",
                                                                                  "params": {"lr": 0.1}}})
    dsfunc.save_checkpoint(state, tmp_path / "ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(dsfunc.InputError, match="no config.json"):
        hf.export_hf(tmp_path / "ckpt", tmp_path / "hf", tmp_path / "empty")
    GPT2Config(**GPT2).save_pretrained(tmp_path / "config")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert cli_export([str(tmp_path / "ckpt"), str(tmp_path / "taken"), "--hf-config", str(tmp_path / "config")]) == 1
    assert "not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    assert cli_export([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf-config", str(tmp_path / "config"),
                        "--max-shard-size", "lots"]) == 1
    assert "cannot read the size 'lots'" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.tmp-*"))


def test_shard_sizes_read_like_hugging_faces():
    assert [hf.parse_size(s) for s in ("5GB", "500MB", "512MiB", "4KB", 1024, "2.5GB")] == \
        [5 * 10**9, 5 * 10**8, 512 * 2**20, 4000, 1024, 25 * 10**8]
