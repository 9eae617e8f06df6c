"""ZeRO-Offload: the masters and optimizer state in host memory, the update on the CPU.

The masters are fp32, or bf16 with ``bf16.bf16_master_weights_and_grads`` (the gradient sums too; the moments
with ``bf16_optimizer_states``: 8 host bytes a parameter with AdamW, DeepSpeed's count): those the host updates
with the transform chain the device would run (:mod:`dsfunc.optim.low_precision`), rounded alike, one unit (and an
element-wise chain a slice of it) at a time (:mod:`dsfunc.optim.low_precision_host`).

Everything offload-specific lives here; the step sees it only through the three policies of
:mod:`dsfunc.zero.policy`, which :func:`placement` makes from the config (:class:`HostOffload` for the parts).
"""

from dsfunc.zero.offload.host import HostOffload
from dsfunc.zero.offload.placement import placement

__all__ = ["HostOffload", "placement"]
