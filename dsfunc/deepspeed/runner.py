"""``deepspeed.launcher.runner``: DeepSpeed's launcher entry, which is the ``dsfunc`` command
(``deepspeed.launcher`` itself is dsfunc's launcher package, :mod:`dsfunc.launcher`)."""

from dsfunc.cli import main
from dsfunc.launcher.environment import DEEPSPEED_ENVIRONMENT_NAME

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main"]
