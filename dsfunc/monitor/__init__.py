"""Progress lines, timings and event files for a training run (:mod:`~dsfunc.monitor.progress`), in
DeepSpeed's CSV and TensorBoard layouts (:mod:`~dsfunc.monitor.writers`)."""

from dsfunc.monitor.progress import Monitor, effective_config, memory_text, startup_summary, tokens_in
from dsfunc.monitor.writers import CsvMonitor, TensorBoardMonitor

__all__ = ["CsvMonitor", "Monitor", "TensorBoardMonitor", "effective_config", "memory_text", "startup_summary",
           "tokens_in"]
