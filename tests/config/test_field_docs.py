"""Every field of every config dataclass has a docstring under it: its meaning in dsfunc, how it differs."""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import dsfunc.config

CONFIG_DIR = Path(dsfunc.config.__file__).parent


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name == "dataclass":
            return True
    return False


def undocumented_fields(source: str) -> list[str]:
    """``Class.field`` for each annotated field of a dataclass in ``source`` with no string under it."""
    missing = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef) or not _is_dataclass(node):
            continue
        for field, after in zip(node.body, [*node.body[1:], None]):
            if not isinstance(field, ast.AnnAssign) or not isinstance(field.target, ast.Name):
                continue
            documented = (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                          and isinstance(after.value.value, str))
            if not documented:
                missing.append(f"{node.name}.{field.target.id}")
    return missing


def test_the_check_finds_a_field_without_a_docstring():
    source = (
        "from dataclasses import dataclass\n"
        "@dataclass(frozen=True)\n"
        "class A:\n"
        '    """A."""\n'
        "    x: int = 0\n"
        '    """Documented."""\n'
        "    y: int = 1\n"
        "    z: int = 2  # a comment is not a docstring\n"
        "class NotADataclass:\n"
        "    w: int = 3\n"
    )
    assert undocumented_fields(source) == ["A.y", "A.z"]


def test_every_config_field_has_a_docstring():
    modules = [m.name for m in pkgutil.iter_modules([str(CONFIG_DIR)])]
    assert {"zero", "offload", "precision", "config", "schema"} <= set(modules)
    missing = {
        name: found
        for name in modules
        if (found := undocumented_fields((CONFIG_DIR / f"{name}.py").read_text(encoding="utf-8")))
    }
    assert not missing, (
        f"config dataclass fields without a docstring under them: {missing}. Add a string literal on the "
        f"line right under each field: what it means in dsfunc, its unit, where it differs from DeepSpeed."
    )
