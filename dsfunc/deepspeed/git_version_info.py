"""``deepspeed.git_version_info``: DeepSpeed's build information (what ``ds_report`` prints and DeepSpeed's own test
helpers read), answered for dsfunc. DeepSpeed records these when it is built; dsfunc builds nothing, so they come
from the running torch, and each version DeepSpeed would write as ``"0.0"`` where there is none (the value its
readers take to mean "ask torch at run time")."""

from __future__ import annotations

import torch

import dsfunc
from dsfunc.deepspeed.accelerator import get_accelerator
from dsfunc.deepspeed.op_builder import __compatible_ops__
from dsfunc.version import git_info


def _major_minor(version: str | None) -> str:
    return ".".join(version.split(".")[:2]) if version else "0.0"


def _nccl() -> str:
    if not torch.cuda.is_available():
        return "0.0"
    major, minor, *_ = torch.cuda.nccl.version()
    return f"{major}.{minor}"


version = dsfunc.__version__
git_hash, git_branch = git_info()
installed_ops = __compatible_ops__  # the native ops dsfunc answers for (its own code, nothing compiled); others False
accelerator_name = get_accelerator().device_name()
torch_info = {
    "version": _major_minor(torch.__version__),
    "bf16_support": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl(),
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}
