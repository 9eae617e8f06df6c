"""dsfunc's version comes from pyproject.toml, installed or not."""

from __future__ import annotations

import importlib.metadata

import pytest

import dsfunc
from dsfunc import version


def _not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version

    def lookup(name: str) -> str:
        if name == "dsfunc":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", lookup)


def test_installed_or_not_the_version_is_pyprojects(monkeypatch):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads(version.PYPROJECT.read_text())["project"]["version"]
    assert dsfunc.__version__ == version.package_version() == declared
    _not_installed(monkeypatch)  # a source tree on sys.path, as the GPU machine runs it
    assert version.package_version() == declared


def test_without_metadata_or_a_version_in_pyproject_it_says_to_install(monkeypatch, tmp_path):
    _not_installed(monkeypatch)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "dsfunc"\ndynamic = ["version"]\n')
    monkeypatch.setattr(version, "PYPROJECT", tmp_path / "pyproject.toml")
    with pytest.raises(ImportError, match="pip install -e ."):
        version.package_version()
