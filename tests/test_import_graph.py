"""dsfunc's modules import one another without a circle.

Every import counts: at module level, inside functions and under ``TYPE_CHECKING`` (a circle that only
the type checker sees still ties two modules' designs together). A package's ``__init__`` is a module
of its own; importing a submodule does not count as importing its package.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "dsfunc").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The dsfunc modules ``name`` imports (``from pkg import sub`` names the submodule ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_the_graph_is_read():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "dsfunc.program" in graph["dsfunc.state"]  # a TYPE_CHECKING import counts
    assert "dsfunc.distributed.comm" in graph["dsfunc.zero.gather"]  # `from dsfunc.distributed import comm`
    assert "dsfunc.launcher.run" in graph["dsfunc.cli"]  # an import inside a function counts


def test_no_module_imports_itself_through_others():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import circle: {' -> '.join(reversed(e.args[1]))}") from None


def test_import_dsfunc_leaves_the_slow_torch_packages_for_later():
    """DCP, DTensor (a second of import time here) and torch.distributed.pipelining (dynamo) load when a
    checkpoint or a pipeline is first used, not with ``import dsfunc``; a notebook starts without them."""
    import subprocess
    import sys

    slow = ["torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.pipelining"]
    code = ("import sys, dsfunc; dsfunc.init_state; dsfunc.save_checkpoint; "
            f"print([m for m in {slow!r} if m in sys.modules])")
    before = subprocess.run([sys.executable, "-c", code.replace("dsfunc.save_checkpoint; ", "")], capture_output=True,
                            text=True, timeout=300, check=True, cwd=ROOT)
    after = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                           cwd=ROOT)
    assert before.stdout.strip() == "[]", before.stdout + before.stderr
    assert "torch.distributed.checkpoint" in after.stdout  # the first use imports it
