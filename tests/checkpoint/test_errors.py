"""What a failed save, load or export raises: dsfunc errors that are also the built-in classes they were."""

from __future__ import annotations

import pytest

import dsfunc
from dsfunc import checkpoint as ckpt
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
