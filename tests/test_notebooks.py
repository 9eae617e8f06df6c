"""The notebooks in notebooks/ run from top to bottom (their assert cells included) in a fresh kernel.

Each is executed with nbclient, with notebooks/ as the working directory and this checkout first on the
kernel's PYTHONPATH; any cell error, or anything written to stderr, fails the test. The executed copy is
discarded: the notebooks are kept in the repository with the outputs they were saved with.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NEEDS = "the notebook tests need {} (pip install -e '.[notebooks]')"
nbformat = pytest.importorskip("nbformat", reason=NEEDS.format("nbformat"))
nbclient = pytest.importorskip("nbclient", reason=NEEDS.format("nbclient"))
pytest.importorskip("ipykernel", reason=NEEDS.format("ipykernel"))
pytest.importorskip("matplotlib", reason=NEEDS.format("matplotlib"))

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = ["01_quickstart", "02_zero_memory", "03_checkpoints", "04_mixed_precision", "05_memory", "06_mesh"]
CELL_TIMEOUT = 240  # seconds; each notebook takes well under two minutes on 2 CPU cores


@pytest.fixture
def kernel_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The environment the kernel inherits: this checkout's dsfunc, one intra-op thread (the notebooks'
    models are tiny, and spinning OpenMP threads make them many times slower on a busy 2-core machine),
    matplotlib's inline backend, and Jupyter's runtime files (connection files) in a temporary directory."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # ipykernel picks the inline backend
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter-runtime"))


def stderr_of(nb: nbformat.NotebookNode) -> list[str]:
    return [
        f"cell {i}: {out.text.strip()}"
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "stream" and out.name == "stderr"
    ]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_its_assertions_hold(name: str, kernel_env: None) -> None:
    nb = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any failing cell
    assert not stderr_of(nb), f"{name} wrote to stderr:\n" + "\n".join(stderr_of(nb))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_kept_with_its_outputs(name: str) -> None:
    """A reader on GitHub sees results and plots without running anything."""
    nb = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{name} was not saved after one run top to bottom: {counts}"
    )
    images = [out for cell in code for out in cell.outputs if "image/png" in out.get("data", {})]
    assert images, f"{name} has no plot in its saved outputs"
    assert not stderr_of(nb), f"{name} was saved with stderr output:\n" + "\n".join(stderr_of(nb))
    errors = [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors, f"{name} was saved with an error: {errors[0].get('ename')}"
