"""Every example in a dsfunc docstring (``>>>``) runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

from tests.modules import dsfunc_modules

WITH_EXAMPLES = [m.__name__ for m in dsfunc_modules() if ">>>" in inspect.getsource(m)]


def test_the_examples_are_found():
    assert len(WITH_EXAMPLES) >= 4, WITH_EXAMPLES


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result}"
