"""The ``tensorboard`` and ``csv_monitor`` sections."""

from __future__ import annotations

from dataclasses import dataclass

from dsfunc.config.checks import _bool, _string
from dsfunc.config.schema import _key


@dataclass(frozen=True)
class MonitorConfig:
    """``tensorboard`` / ``csv_monitor``: events go to ``os.path.join(output_path, job_name)`` on rank 0."""

    enabled: bool = _key(False, _bool)
    output_path: str = _key("", _string)
    job_name: str = _key("DeepSpeedJobName", _string)
