"""Progress lines, timings and event files for a training run (:mod:`~dsfunc.monitor.progress`), in
DeepSpeed's CSV and TensorBoard layouts (:mod:`~dsfunc.monitor.writers`) or to wandb and Comet
(:mod:`~dsfunc.monitor.wandb`, :mod:`~dsfunc.monitor.comet`); model FLOPs counted once on a meta copy
(:mod:`~dsfunc.monitor.flops`) for the progress line's tflops and mfu (:mod:`~dsfunc.monitor.utilisation`) and
DeepSpeed's FLOPs profile (:mod:`~dsfunc.monitor.profile`, :mod:`~dsfunc.monitor.flops_profiler`)."""

from dsfunc.monitor.comet import CometMonitor
from dsfunc.monitor.flops import FlopCount, count_flops
from dsfunc.monitor.progress import Monitor, effective_config, memory_text, startup_summary, tokens_in
from dsfunc.monitor.wandb import WandbMonitor
from dsfunc.monitor.writers import CsvMonitor, TensorBoardMonitor

__all__ = ["CometMonitor", "CsvMonitor", "FlopCount", "Monitor", "TensorBoardMonitor", "WandbMonitor", "count_flops",
           "effective_config", "memory_text", "startup_summary", "tokens_in"]
