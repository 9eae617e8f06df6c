"""DeepSpeed's own surface, as shells over the functional core: ``import dsfunc as deepspeed`` runs
scripts written for DeepSpeed's engine::

    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=net,
                                                                model_parameters=net.parameters(),
                                                                training_data=trainset)
    for inputs, labels in loader:
        loss = criterion(engine(inputs), labels)
        engine.backward(loss)
        engine.step()

The rest of DeepSpeed's namespace (``deepspeed.accelerator``, ``deepspeed.comm``, ``deepspeed.ops``,
``deepspeed.utils``, ``deepspeed.zero``, ...) is answered by :mod:`dsfunc.deepspeed.namespace`.
"""

from dsfunc.deepspeed.accelerator import get_accelerator
from dsfunc.deepspeed.arguments import add_config_arguments
from dsfunc.deepspeed.autotp import tp_model_init
from dsfunc.deepspeed.config import DeepSpeedConfig, DeepSpeedConfigError
from dsfunc.deepspeed.engine import DeepSpeedEngine, Engine
from dsfunc.deepspeed.initialize import initialize
from dsfunc.deepspeed.namespace import (
    DeepSpeedHybridEngine,
    DeepSpeedTransformerConfig,
    DeepSpeedTransformerLayer,
    InferenceEngine,
    add_tuning_arguments,
    init_inference,
)
from dsfunc.deepspeed.ops import DeepSpeedOptimizer
from dsfunc.deepspeed.pipe import PipelineModule
from dsfunc.deepspeed.pipe_engine import PipelineEngine
from dsfunc.deepspeed.utils import OnDevice, log_dist, logger

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "DeepSpeedHybridEngine",
    "DeepSpeedOptimizer",
    "DeepSpeedTransformerConfig",
    "DeepSpeedTransformerLayer",
    "Engine",
    "InferenceEngine",
    "OnDevice",
    "PipelineEngine",
    "PipelineModule",
    "add_config_arguments",
    "add_tuning_arguments",
    "get_accelerator",
    "init_inference",
    "initialize",
    "log_dist",
    "logger",
    "tp_model_init",
]
