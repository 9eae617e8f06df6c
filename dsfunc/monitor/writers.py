"""Event files in DeepSpeed's layouts: one CSV file per event, or TensorBoard scalars."""

from __future__ import annotations

import csv
import os

from dsfunc.errors import MissingDependencyError


class CsvMonitor:
    """DeepSpeed's CSV monitor: ``<dir>/<event with / replaced by _>.csv`` with rows ``step,value``."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        by_file: dict[str, list[tuple[int, float]]] = {}
        for name, value, x in events:
            by_file.setdefault(name, []).append((x, value))
        for name, rows in by_file.items():
            path = os.path.join(self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv")
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerows(rows)

    def close(self) -> None:
        """Nothing stays open between writes."""


class TensorBoardMonitor:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package)."""

    def __init__(self, output_path: str, job_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise MissingDependencyError(
                'the config enables "tensorboard", but the tensorboard package is not installed: '
                "`pip install tensorboard` (or dsfunc[tensorboard]), or set tensorboard.enabled to false"
            ) from None
        self.log_dir = os.path.join(output_path, job_name)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, x in events:
            self.writer.add_scalar(name, value, x)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
