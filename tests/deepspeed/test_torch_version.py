"""``deepspeed.utils.torch.required_torch_version`` answers as real DeepSpeed's for the installed torch."""

from __future__ import annotations

import pytest
import torch

import dsfunc
from dsfunc.deepspeed.torch_version import required_torch_version
from dsfunc.errors import InputError

MAJOR_MINOR = ".".join(torch.__version__.split(".")[:2])  # "2.13"
BOUNDS = [
    {"min_version": 1.8}, {"max_version": 1.8}, {"min_version": MAJOR_MINOR}, {"max_version": MAJOR_MINOR},
    {"min_version": float(MAJOR_MINOR)}, {"min_version": "99.0"}, {"max_version": "99.0"},
    {"min_version": torch.__version__}, {"max_version": torch.__version__},
    {"min_version": "1.0", "max_version": MAJOR_MINOR + ".99"},
]


@pytest.mark.parametrize("bounds", BOUNDS)
def test_as_real_deepspeed(bounds):
    real = pytest.importorskip("deepspeed.utils.torch", reason="real DeepSpeed is the reference")
    assert required_torch_version(**bounds) == real.required_torch_version(**bounds)


def test_answers_without_deepspeed():
    assert required_torch_version(min_version=1.8) and not required_torch_version(max_version=1.8)
    assert required_torch_version(max_version=torch.__version__) and not required_torch_version(min_version="99")
    assert required_torch_version(min_version=MAJOR_MINOR, max_version=torch.__version__)


def test_needs_a_bound():
    with pytest.raises(InputError, match="min_version= or max_version="):
        required_torch_version()


def test_under_deepspeeds_module_path():
    from dsfunc.utils.torch import required_torch_version as answered  # DeepSpeed's path, under dsfunc

    assert answered is required_torch_version
    # the submodule is now the attribute ``torch`` of deepspeed.utils: its own helpers still find torch
    with dsfunc.utils.OnDevice(dtype=torch.float16, device="meta"):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float16
    dsfunc.utils.set_random_seed(3)
