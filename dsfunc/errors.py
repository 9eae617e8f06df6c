"""The errors dsfunc raises on purpose.

Each derives from :class:`Error` and from the built-in class that describes it (``ValueError``,
``TypeError``, ``RuntimeError``), so ``except dsfunc.Error`` catches everything dsfunc reports while
``except ValueError`` keeps working. Errors of one subsystem live with it (``ConfigError`` in
:mod:`dsfunc.config`, ``CheckpointError`` in :mod:`dsfunc.checkpoint`, ...); these are the general ones.
"""

from __future__ import annotations


class Error(Exception):
    """Base of every error dsfunc raises on purpose; the message says what is wrong and what to do."""


class InputError(Error, ValueError):
    """A value given to dsfunc cannot work: an argument, a batch, a model, a hyper-parameter."""


class InputTypeError(Error, TypeError):
    """An argument of the wrong type."""


class UsageError(Error, RuntimeError):
    """A call made at the wrong time or in the wrong order (a consumed state, the engine's call order)."""


class MissingDependencyError(Error, ImportError):
    """An optional package a requested feature needs is not installed (the message names it)."""


class NotSupportedError(Error, NotImplementedError):
    """A DeepSpeed feature dsfunc does not implement was called (the message names it and what to use)."""


def unsupported(name: str, feature: str, hint: str = "") -> type:
    """A stand-in for DeepSpeed's ``name`` that imports fine and raises :class:`NotSupportedError` when
    called or instantiated, so a script that imports it at top level but never uses it still runs.

    It is a class, so ``isinstance(x, name)`` is simply False.
    """
    message = f"{name} ({feature}) is not implemented by dsfunc" + (f"; {hint}" if hint else "")

    def refuse(cls: type, *args: object, **kwargs: object) -> None:
        raise NotSupportedError(message)

    short = name.rpartition(".")[2]
    return type(short, (), {"__new__": refuse, "__doc__": f"Not in dsfunc: {message}.", "__module__": "dsfunc"})
