"""The environment a launch carries to every node: forwarded variables, .deepspeed_env, .dsfunc_env."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from dsfunc.errors import Error

#: Variables whose name starts with one of these are forwarded to every node (DeepSpeed's list plus NCCL).
EXPORT_PREFIXES = ("NCCL", "PYTHON", "UCX", "MLFLOW", "MV2")
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"  # DeepSpeed's environment file (deepspeed.launcher.runner's name)

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EnvFileError(Error, ValueError):
    """A line of an environment file is not ``KEY=VALUE``."""


def parse_env_file(text: str, path: str) -> dict[str, str]:
    """Parse ``KEY=VALUE`` lines (blank lines and ``#`` comment lines allowed; a value may be wrapped in one
    pair of matching quotes, which are removed). A bad line raises :class:`EnvFileError` naming file and
    line."""
    values: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY.fullmatch(key):
            raise EnvFileError(
                f"{path}:{lineno}: expected KEY=VALUE (KEY made of letters, digits and '_'), "
                f"got {raw.strip()!r}"
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key] = value
    return values


def env_file_paths(cwd: str, home: str, environ: Mapping[str, str]) -> list[str]:
    """Existing environment files, in the order they apply (later wins): home before the working directory,
    ``.deepspeed_env`` (renamed by ``DS_ENV_FILE``) before ``.dsfunc_env``."""
    names = [environ.get("DS_ENV_FILE", DEEPSPEED_ENVIRONMENT_NAME), ".dsfunc_env"]
    dirs = [home] if os.path.realpath(home) == os.path.realpath(cwd) else [home, cwd]
    paths = [os.path.join(d, n) for d in dirs for n in names]
    return [p for p in paths if os.path.isfile(p)]


def read_env_files(cwd: str, home: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Merged contents of the environment files that exist (see :func:`env_file_paths`)."""
    values: dict[str, str] = {}
    for path in env_file_paths(cwd, home, environ):
        with open(path) as f:
            values.update(parse_env_file(f.read(), path))
    return values


def exported_env(environ: Mapping[str, str], cwd: str, home: str) -> dict[str, str]:
    """Variables every node's ranks must get: those with an :data:`EXPORT_PREFIXES` prefix, then the
    environment files' values. The working directory is prepended to ``PYTHONPATH`` so that the job's own
    modules import the same way on every node."""
    exports = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    path = exports.get("PYTHONPATH", "")
    exports["PYTHONPATH"] = cwd + (os.pathsep + path if path else "")
    exports.update(read_env_files(cwd, home, environ))
    return exports
