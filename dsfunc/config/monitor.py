"""The monitor sections: ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet`` (DeepSpeed's keys and
defaults, ``deepspeed/monitor/config.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from dsfunc.config.checks import _bool, _choice, _integer, _optional, _string
from dsfunc.config.schema import _key

_NAME = _optional(_string)


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


@dataclass(frozen=True)
class WandbConfig:
    """``wandb``: the same scalars as a Weights & Biases run (``wandb.init`` on rank 0; needs ``wandb``)."""

    enabled: bool = _key(False, _bool)
    """Log the scalars to a wandb run (x = global samples, wandb's ``step``)."""
    group: str | None = _key(None, _NAME)
    """The wandb group of the run."""
    team: str | None = _key(None, _NAME)
    """The wandb entity (team or user) the run belongs to."""
    project: str = _key("deepspeed", _string)
    """The wandb project (DeepSpeed's default, "deepspeed"). WANDB_MODE=offline keeps the run on disk."""


@dataclass(frozen=True)
class CometConfig:
    """``comet``: the same scalars as a Comet experiment (``comet_ml.start`` on rank 0; needs ``comet_ml``).
    Unset keys fall back to Comet's own configuration (``.comet.config``, ``COMET_*`` variables)."""

    enabled: bool = _key(False, _bool)
    """Log the scalars to a Comet experiment."""
    samples_log_interval: int = _key(100, _integer())
    """Log each event again only after this many more global samples (DeepSpeed's default 100)."""
    project: str | None = _key(None, _NAME)
    """The Comet project name."""
    workspace: str | None = _key(None, _NAME)
    """The Comet workspace."""
    api_key: str | None = _key(None, _NAME)
    """The Comet API key (better given as COMET_API_KEY)."""
    experiment_name: str | None = _key(None, _NAME)
    """The experiment's name."""
    experiment_key: str | None = _key(None, _NAME)
    """The key of the experiment to log to (32 to 50 alphanumeric characters)."""
    online: bool | None = _key(None, _optional(_bool))
    """false: an offline experiment, an archive in COMET_OFFLINE_DIRECTORY to upload later (Comet's default:
    online)."""
    mode: str | None = _key(None, _optional(_choice("get", "create", "get_or_create")))
    """"get" an existing experiment (experiment_key), "create" a new one, or "get_or_create" (Comet's default)."""
