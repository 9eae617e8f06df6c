"""DeepSpeed's own surface, as shells over the functional core: ``import dsfunc as deepspeed`` runs
scripts written for DeepSpeed's engine::

    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=net,
                                                                model_parameters=net.parameters(),
                                                                training_data=trainset)
    for inputs, labels in loader:
        loss = criterion(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
"""

from dsfunc.deepspeed.arguments import add_config_arguments
from dsfunc.deepspeed.engine import Engine
from dsfunc.deepspeed.initialize import initialize

__all__ = ["Engine", "add_config_arguments", "initialize"]
