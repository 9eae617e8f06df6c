"""What a failed save, load or export raises: dsfunc errors that are also the built-in classes they were."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from dsfunc import checkpoint as ckpt
from dsfunc.checkpoint.compat import differences
from dsfunc.errors import Error, InputError, InputTypeError
from tests.models import MLP, config


def test_checkpoint_errors_are_dsfunc_errors_and_runtime_errors():
    classes = (ckpt.CheckpointError, ckpt.CheckpointNotFoundError, ckpt.CheckpointCorruptError,
               ckpt.CheckpointMismatchError, ckpt.CheckpointTimeoutError, ckpt.CheckpointUnsupportedError)
    assert all(issubclass(cls, Error) and issubclass(cls, RuntimeError) for cls in classes)
    assert all(issubclass(cls, ckpt.CheckpointError) for cls in classes)
    assert issubclass(ckpt.CheckpointMismatchError, ValueError)
    assert dsfunc.CheckpointError is ckpt.CheckpointError


def test_bad_arguments_are_input_errors(tmp_path):
    state = dsfunc.init_state(MLP(), config())
    with pytest.raises(InputError, match="save_dir is empty"):
        ckpt.save_checkpoint(state, "")
    with pytest.raises(InputError, match="invalid checkpoint tag"):
        ckpt.save_checkpoint(state, tmp_path, tag=".hidden")
    with pytest.raises(InputTypeError, match="load_checkpoint expects a TrainState"):
        ckpt.load_checkpoint(tmp_path, {"params": 1})
    with pytest.raises(InputError, match="format must be one of"):
        ckpt.export_fp32(tmp_path, tmp_path / "w.pt", format="npz")
    with pytest.raises(InputError, match="name it \\*.safetensors or \\*.pt"):
        ckpt.export_fp32(tmp_path, tmp_path / "w.npz")
    assert not any(tmp_path.iterdir())



def test_a_state_dict_file_is_named_as_a_file_with_what_to_do(tmp_path):
    state = dsfunc.init_state(MLP(), config())
    path = tmp_path / "model.pt"
    torch.save(dsfunc.full_params(state), path)
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"model\.pt is a file, not a checkpoint directory: "
                                                           r"(.|\n)*model\.load_state_dict\(torch\.load\("):
        ckpt.load_checkpoint(path, state)
    assert not state.donated


def test_a_mismatch_is_counted_one_entry_a_line_and_bounded():
    lines = differences({f"layer{i}.weight": (4,) for i in range(25)} | {"head": (3,)}, {"head": (2,)}, "the model")
    assert lines[0] == "  in the checkpoint but not in the model (25):"
    assert lines[1:11] == [f"    layer{i}.weight" for i in sorted(range(25), key=str)][:10]
    assert lines[11] == "    ... and 15 more"
    assert lines[12:] == ["  different (1):", "    head (checkpoint (3,), the model (2,))"]
