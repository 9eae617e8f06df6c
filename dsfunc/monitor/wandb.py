"""The ``wandb`` monitor: the run's scalars in a Weights & Biases run, x = global samples (wandb's ``step``)."""

from __future__ import annotations

from typing import Any

from dsfunc.config import WandbConfig
from dsfunc.errors import MissingDependencyError


class WandbMonitor:
    """``wandb.init(project, group, entity=team)`` once (rank 0 only builds one), then ``run.log`` per x.

    ``WANDB_MODE=offline`` keeps the run in ``$WANDB_DIR/wandb/offline-run-*`` for ``wandb sync``.
    """

    def __init__(self, config: WandbConfig) -> None:
        try:
            import wandb
        except ImportError:
            raise MissingDependencyError(
                'the config enables "wandb", but the wandb package is not installed: `pip install wandb` '
                "(or dsfunc[wandb]), or set wandb.enabled to false"
            ) from None
        self.run: Any = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        by_x: dict[int, dict[str, float]] = {}
        for name, value, x in events:
            by_x.setdefault(x, {})[name] = value
        for x, values in by_x.items():
            self.run.log(values, step=x)

    def close(self) -> None:
        self.run.finish()
