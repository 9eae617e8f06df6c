"""``deepspeed.runtime.zero.partition_parameters``: ZeRO-3's context managers and parameter status
(:mod:`dsfunc.deepspeed.zero_context`), and the tensor-constructor hook libraries swap around ``zero.Init``.

DeepSpeed's ``zero.Init`` wraps torch's tensor constructors (``torch.empty``, ``torch.arange``, ...) with
:func:`zero_wrapper_for_fp_tensor_constructor` to place them and cast them to the ZeRO dtype;
Hugging Face swaps that function (keeping ``torch.arange`` uncast for RoPE buffers). dsfunc's ``Init``
wraps no constructor (it partitions each parameter once its module is built), so the function here is the
identity and swapping it changes nothing, which is what the swap wants.
"""

from collections.abc import Callable
from typing import Any

import torch

from dsfunc.deepspeed.accelerator import get_accelerator
from dsfunc.deepspeed.namespace import other_name
from dsfunc.deepspeed.zero_context import GatheredParameters, Init, register_external_parameter
from dsfunc.zero.placeholders import ZeroParamStatus

_orig_torch_arange = torch.arange  # DeepSpeed's name for the unwrapped constructor
partitioned_param_data_shape = [0]  # the shape of a ZeRO-3 parameter that is not gathered (DeepSpeed's name)


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., Any], target_fp_dtype: torch.dtype,
                                           target_device: Any = None) -> Callable[..., Any]:
    """``fn`` itself: dsfunc's ``zero.Init`` leaves tensor constructors alone."""
    return fn


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "partitioned_param_data_shape",
           "register_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]


def __getattr__(name: str) -> Any:
    """DeepSpeed's other names of the module (its all-gather handles, ...) import, and refuse when used."""
    return other_name("runtime.zero.partition_parameters", name)
