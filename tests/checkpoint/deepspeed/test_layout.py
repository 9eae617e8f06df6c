"""Which DeepSpeed folders dsfunc reads: tags and ``latest`` resolved like its own, refused layouts and
missing ranks named by file, before anything is read into the template."""

from __future__ import annotations

import shutil

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from tests.checkpoint.deepspeed.common import Case, Net

CASE = Case(2, 2, "bf16")


def template() -> dsfunc.TrainState:
    return dsfunc.init_state(Net(), CASE.config(world=1, stage=0))


@pytest.fixture
def copy(ds_root, tmp_path):
    """A writable copy of one DeepSpeed ``save_dir``."""
    return shutil.copytree(ds_root / CASE.name, tmp_path / CASE.name)


def test_tags_and_latest_resolve_as_for_dsfunc_checkpoints(copy):
    folder = copy / "global_step3"
    assert ckpt.find_checkpoint(copy) == folder  # DeepSpeed's latest
    assert ckpt.find_checkpoint(copy, "global_step3") == folder
    assert ckpt.find_checkpoint(folder) == folder
    assert ckpt.available_tags(copy) == ["global_step3"]
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"no checkpoint tagged 'global_step9'.*'global_step3'"):
        ckpt.load_checkpoint(copy, template(), tag="global_step9")
    state, client = ckpt.load_checkpoint(copy, template(), tag="global_step3")
    assert int(state.step) == 3 and client["epoch"] == 3


@pytest.mark.parametrize(("name", "message"), [
    ("layer_01-model_00-model_states.pt", "pipeline-parallel layer weights"),
    ("expert_3_mp_rank_00_model_states.pt", "experts in the layout of DeepSpeed before 0.6"),
    ("offloaded_tensors", "offloaded to NVMe"),
])
def test_unsupported_layouts_are_refused_naming_the_file(copy, name, message):
    path = copy / "global_step3" / name
    path.mkdir() if name == "offloaded_tensors" else path.write_bytes(b"")
    state = template()
    with pytest.raises(ckpt.CheckpointUnsupportedError, match=message) as e:
        ckpt.load_checkpoint(copy, state)
    assert str(path) in str(e.value)
    assert not state.donated  # refused before anything was read into it


@pytest.mark.parametrize(("name", "error", "message"), [
    ("layer_0_expert_3_mp_rank_00_model_states.pt", ckpt.CheckpointCorruptError,
     r"layer_0_expert_0_mp_rank_00_model_states.pt, .*expert_2_.* is missing \(every expert writes its own"),
    ("layer_1_expert_0_mp_rank_00_model_states.pt", ckpt.CheckpointCorruptError, "no file of MoE layer 0's experts"),
    ("expp_rank_0_mp_rank_00_optim_states.pt", ckpt.CheckpointCorruptError, "no expert's weights"),
    ("mp_rank_01_model_states.pt", ckpt.CheckpointCorruptError, "mp_rank_01_model_states.pt"),
    ("bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", ckpt.CheckpointCorruptError, "no mp_rank_01_model_states.pt"),
])
def test_a_damaged_or_partial_tp_rank_or_expert_is_named(copy, name, error, message):
    """A second tp rank's files (AutoTP) and MoE experts' files are read: an empty one, one without its model
    states, a layer's experts without expert 0 or without layer 0, an expert optimizer without experts, is named."""
    (copy / "global_step3" / name).write_bytes(b"")
    state = template()
    with pytest.raises(error, match=message):
        ckpt.load_checkpoint(copy, state)
    assert not state.donated


def test_a_missing_rank_is_named(copy):
    (copy / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ckpt.CheckpointCorruptError, match="bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt is missing"):
        ckpt.load_checkpoint(copy, template())
    (copy / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").rename(
        copy / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")  # only "rank 0" is left
    with pytest.raises(ckpt.CheckpointCorruptError, match="one of 2 data-parallel ranks.*holds 1"):
        ckpt.load_checkpoint(copy, template())


def test_a_damaged_file_is_named_and_the_template_stays_usable(copy):
    main = copy / "global_step3" / "mp_rank_00_model_states.pt"
    main.write_bytes(main.read_bytes()[:100])
    state = template()
    with pytest.raises(ckpt.CheckpointCorruptError, match=r"mp_rank_00_model_states\.pt is not a readable torch\.save "
                                                          "file: BadZipFile"):
        ckpt.load_checkpoint(copy, state)
    assert not state.donated
    torch.save({"not": "deepspeed"}, main)
    with pytest.raises(ckpt.CheckpointCorruptError, match="not a DeepSpeed model-states file"):
        ckpt.load_checkpoint(copy, state)
