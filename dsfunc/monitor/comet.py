"""The ``comet`` monitor: the run's scalars in a Comet experiment, x = global samples (Comet's ``step``)."""

from __future__ import annotations

from typing import Any

from dsfunc.config import CometConfig
from dsfunc.errors import MissingDependencyError


class CometMonitor:
    """``comet_ml.start(...)`` once (rank 0 only builds one); an event is logged again only after
    ``samples_log_interval`` more samples, as DeepSpeed's Comet monitor does.

    ``"online": false`` (or ``COMET_START_ONLINE=0``) writes an offline archive into ``COMET_OFFLINE_DIRECTORY``
    for ``comet upload``.
    """

    def __init__(self, config: CometConfig) -> None:
        try:
            import comet_ml
        except ImportError:
            raise MissingDependencyError(
                'the config enables "comet", but the comet_ml package is not installed: `pip install comet_ml` '
                "(or dsfunc[comet]), or set comet.enabled to false"
            ) from None
        self.interval = config.samples_log_interval
        self.experiment: Any = comet_ml.start(api_key=config.api_key, project=config.project,
                                              workspace=config.workspace, experiment_key=config.experiment_key,
                                              mode=config.mode, online=config.online)
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self._logged_at: dict[str, int] = {}  # event -> the samples when it was last logged

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, x in events:
            last = self._logged_at.get(name)
            if last is None or x - last >= self.interval:
                self._logged_at[name] = x
                self.experiment.log_metric(name, value, step=x)

    def close(self) -> None:
        self.experiment.end()
