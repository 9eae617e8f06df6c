"""A pytest plugin for tests/test_collection.py: each test file pytest's own walk reaches is collected as one item
named after it, without importing it (the walk, ``norecursedirs`` and ``python_files`` are what is tested; importing
every test module took most of a minute)."""

from __future__ import annotations

import pytest


class _Reached(pytest.Item):
    def runtest(self) -> None:
        raise AssertionError("collect-only: never run")


class _File(pytest.File):
    def collect(self):
        yield _Reached.from_parent(self, name="reached")


def pytest_pycollect_makemodule(module_path, parent):
    return _File.from_parent(parent, path=module_path)
