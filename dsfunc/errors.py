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
