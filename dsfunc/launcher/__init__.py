"""The ``dsfunc`` launcher (DeepSpeed's ``deepspeed`` command on PyTorch's elastic agent).

:mod:`~dsfunc.launcher.flags` parses the command line, :mod:`~dsfunc.launcher.resources` picks hosts and
slots, :mod:`~dsfunc.launcher.environment` gathers what every rank gets, :mod:`~dsfunc.launcher.run`
chooses a runner and starts it with :mod:`~dsfunc.launcher.commands`, :mod:`~dsfunc.launcher.supervise`
stops everything when one part fails; on each node :mod:`~dsfunc.launcher.node` runs the elastic agent and
:mod:`~dsfunc.launcher.shim` starts each rank's program.
"""
