"""Pipeline parallelism: a model's layers split over stages, each rank training one stage, the micro-batches
of a step run by a ``torch.distributed.pipelining`` schedule.

``dsfunc.init_state(layers, config, loss_fn, pipeline={"stages": 2})`` (or the config's ``pipeline``
section) builds this rank's stage (:mod:`.stage`, :mod:`.partition`) in a grid of stages x data-parallel
replicas x tensor-parallel ranks (:mod:`.topology`, the run's ``pp x dp x tp`` mesh); ``dsfunc.train_step`` then
runs the pipelined step (:mod:`.pipelined`, :mod:`.schedules`), with ZeRO over each stage's replicas. DeepSpeed's ``deepspeed.pipe`` is a shell over it
(:mod:`dsfunc.deepspeed.pipe`).
"""

from dsfunc.pipeline.stage import LayerSpec, StageModule, TiedLayerSpec

__all__ = ["LayerSpec", "StageModule", "TiedLayerSpec"]
