"""The ``tensorboard`` and ``csv_monitor`` sections."""

from __future__ import annotations

from dataclasses import dataclass

from dsfunc.config.checks import _bool, _string
from dsfunc.config.schema import _key


@dataclass(frozen=True)
class MonitorConfig:
    """``tensorboard`` / ``csv_monitor``: events go to ``os.path.join(output_path, job_name)`` on rank 0."""

    enabled: bool = _key(False, _bool)
    """Write this monitor's scalars (loss, lr, fp16 loss scale; x = global samples) from rank 0."""
    output_path: str = _key("", _string)
    """The directory the job_name directory goes in; "" (the default, as DeepSpeed's) is the working
    directory.
    """
    job_name: str = _key("DeepSpeedJobName", _string)
    """The directory of this run's files inside output_path (DeepSpeed's default name)."""
