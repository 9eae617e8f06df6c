"""``dsfunc export`` of DeepSpeed checkpoints: the plain module loads the fp32 file, and a DeepSpeed-trained
GPT-2 becomes a Hugging Face directory with the trained model's weights exactly (and so its logits)."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

import dsfunc
from dsfunc.checkpoint.deepspeed.mapping import IMPORT_STATS
from dsfunc.cli import export as cli_export
from tests.checkpoint.deepspeed.common import Case, Net
from tests.models import relative_diff


def loaded(ds_root, case: Case) -> dict[str, torch.Tensor]:
    """What ``dsfunc.load_checkpoint`` makes of the checkpoint: the weights the export must equal."""
    state = dsfunc.init_state(Net(), case.config(world=1, stage=0))
    state, _ = dsfunc.load_checkpoint(ds_root / case.name, state)
    return dsfunc.full_params(state)


@pytest.mark.parametrize("case", [Case(0, 1, "fp32"), Case(1, 2, "bf16"), Case(2, 2, "fp16"), Case(3, 2, "bf16"),
                                  Case(1, 2, "bf16", grad_accum_fp32=True)], ids=lambda c: c.name)
def test_the_fp32_file_loads_into_the_plain_module(ds_root, tmp_path, case):
    expected = loaded(ds_root, case)
    out = tmp_path / "w.safetensors"
    assert cli_export([str(ds_root / case.name), str(out)]) == 0
    assert cli_export([str(ds_root / case.name / "global_step3"), str(tmp_path / "w.pt")]) == 0
    pt = torch.load(tmp_path / "w.pt", weights_only=True)
    assert list(pt) == list(Net().state_dict())  # the module's names, tied ones included, in its order
    for sd in (safetensors.torch.load_file(out), pt):
        assert sorted(sd) == sorted(Net().state_dict())
        plain = Net()
        plain.load_state_dict(sd)  # strict
        assert relative_diff(dict(plain.state_dict()), expected) == 0.0
        assert all(t.dtype == torch.float32 for t in sd.values())
    assert pt["head.weight"].data_ptr() == pt["emb.weight"].data_ptr()  # tied names share one tensor


def test_the_export_reads_one_batch_of_tensors_at_a_time(ds_root, tmp_path):
    from dsfunc.checkpoint.deepspeed.weights import deepspeed_weights

    IMPORT_STATS.max_elements = 0
    layout, _, _, tensors = deepspeed_weights(ds_root / "s3_w2_bf16" / "global_step3", with_aliases=False,
                                              batch_bytes=64 * 4)
    assert [name for name, _ in tensors] == [name for name, _, _ in layout]
    assert IMPORT_STATS.max_elements == 16 * 8  # the embedding, the largest tensor, alone in its batch
    assert IMPORT_STATS.live == 0


def test_a_stage0_16_bit_checkpoint_with_frozen_parameters_needs_the_model(ds_root, tmp_path, capsys):
    """DeepSpeed's stage-0 fp16/bf16 optimizer records neither names nor which parameters were frozen."""
    assert cli_export([str(ds_root / "s0_w2_bf16"), str(tmp_path / "w.safetensors")]) == 1
    assert "Load it into a state built from the same model" in capsys.readouterr().err


def test_a_deepspeed_gpt2_exports_to_hugging_face_with_its_logits(ds_root, tmp_path):
    ckpt = ds_root / "gpt2"
    assert cli_export([str(ckpt), str(tmp_path / "hf"), "--hf-config", str(ckpt / "hf_config"),
                        "--max-shard-size", "4KB"]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and model.dtype == torch.float32
    reference = torch.load(ckpt / "reference.pt")
    exported = model.state_dict()
    assert all(torch.equal(exported[name], weight) for name, weight in reference["params"].items())
    # The logits were recorded on the machine that made the fixtures; another CPU's kernels may round
    # differently (1.6e-7 relative on an AMD EPYC against the Intel Xeon's record), hence fp32's tolerance.
    with torch.no_grad():
        logits = model.eval()(reference["input_ids"]).logits
    assert relative_diff({"logits": logits}, {"logits": reference["logits"]}) <= 1e-6
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
