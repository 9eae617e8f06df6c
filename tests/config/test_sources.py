"""Config sources: JSON files (read as HJSON, as DeepSpeed reads them), base64, argparse namespaces, Configs,
dicts."""

from __future__ import annotations

import argparse
import base64
import copy
import json
from pathlib import Path

import pytest

from dsfunc.config import Config, ConfigError
from tests.config.helpers import error


def test_json_file_str_and_pathlike(tmp_path: Path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}}))
    for source in (path, str(path)):
        c = Config.load(source, world_size=2)
        assert c.train_batch_size == 8 and c.fp16.enabled
        assert c.raw == {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}}


def test_hjson_file(tmp_path: Path):
    """Comments, trailing commas and unquoted keys, as DeepSpeed's hjson reads them."""
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  # batch\n  train_batch_size: 8, // per step\n  "fp16": {"enabled": true,},\n}')
    c = Config.load(path, world_size=2)
    assert c.train_micro_batch_size_per_gpu == 4 and c.fp16.enabled


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": }\n}', "invalid JSON (read as HJSON) at line 3, column"),
        (
            '{"train_batch_size": 8, "train_batch_size": 16}',
            'Duplicate key "train_batch_size" in the config; keep one.',
        ),
        ("[1, 2]", "the config must be a JSON object, got list"),
    ],
)
def test_bad_json_files(tmp_path: Path, text, expected):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        Config.load(path)
    assert expected in str(info.value) and str(path) in str(info.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="DeepSpeed config file 'no/such/ds_config.json' does not exist"):
        Config.load("no/such/ds_config.json")
    with pytest.raises(ConfigError, match="Cannot read the DeepSpeed config file 'no/such.json'"):
        Config.load(Path("no/such.json"))


def test_base64_string():
    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 12}).encode()).decode()
    assert Config.load(encoded, world_size=3).train_micro_batch_size_per_gpu == 4


def test_argparse_namespace(tmp_path: Path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 16, "gradient_accumulation_steps": 2}')
    args = argparse.Namespace(deepspeed=True, deepspeed_config=str(path), local_rank=0)
    assert Config.load(args, world_size=2).train_micro_batch_size_per_gpu == 4
    assert Config.load(argparse.Namespace(deepspeed_config={"train_batch_size": 4})).train_batch_size == 4
    assert Config.load(argparse.Namespace(deepscale_config=str(path)), world_size=2).train_batch_size == 16
    with pytest.raises(
        ConfigError, match="args.deepspeed_config is not set: pass --deepspeed_config ds_config.json"
    ):
        Config.load(argparse.Namespace(deepspeed=True))
    with pytest.raises(ConfigError, match="args.deepspeed_config is not set"):
        Config.load(argparse.Namespace(deepspeed_config=None))


def test_unsupported_source_type():
    with pytest.raises(ConfigError, match="Cannot read a DeepSpeed config from a int"):
        Config.load(42)


def test_config_source_is_reresolved_for_another_world_size():
    c = Config.load({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert c.gradient_accumulation_steps == 4
    assert Config.load(c, world_size=2) is c
    c4 = Config.load(c, world_size=4)
    assert (
        c4.world_size,
        c4.train_batch_size,
        c4.train_micro_batch_size_per_gpu,
        c4.gradient_accumulation_steps,
    ) == (4, 32, 4, 2)
    assert c4.raw == c.raw
    per_rank = Config.load(
        {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, world_size=2
    )
    assert Config.load(per_rank, world_size=4).train_batch_size == 32
    assert "not divisible by train_micro_batch_size_per_gpu * world_size = 4 * 16 = 64" in error(
        c.raw, world_size=16
    )


def test_dict_source_is_not_mutated_and_later_changes_do_not_leak():
    raw = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.99]}}}
    before = copy.deepcopy(raw)
    c = Config.load(raw)
    assert raw == before
    raw["optimizer"]["params"]["betas"][0] = 0.5
    assert c.raw["optimizer"]["params"]["betas"] == (0.9, 0.99)
