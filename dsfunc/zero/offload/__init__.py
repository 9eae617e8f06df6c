"""ZeRO-Offload: the fp32 masters and optimizer state in host memory, the update on the CPU.

Everything offload-specific lives here; the step sees it only through the three policies of
:mod:`dsfunc.zero.policy`, which :func:`placement` makes from the config (:class:`HostOffload` for the parts).
"""

from dsfunc.zero.offload.host import HostOffload
from dsfunc.zero.offload.placement import placement

__all__ = ["HostOffload", "placement"]
