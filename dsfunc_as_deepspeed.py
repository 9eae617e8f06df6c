"""``DSFUNC_AS_DEEPSPEED=1``: dsfunc answers as DeepSpeed, so libraries built on DeepSpeed (Hugging Face
``Trainer``, accelerate) run on dsfunc with no change.

With the variable set when the interpreter starts, ``import deepspeed`` is ``import dsfunc``, every
``deepspeed.X`` is ``dsfunc.X`` (the same module objects as dsfunc's DeepSpeed namespace,
:mod:`dsfunc.deepspeed.namespace`), and ``importlib.metadata`` finds a ``deepspeed`` distribution of
version :data:`VERSION`, so availability and version checks pass. Without it nothing changes, and a
real DeepSpeed installed beside dsfunc imports as usual.

``dsfunc_as_deepspeed.pth``, installed with dsfunc (regular or editable install), runs :func:`from_environment`
at every interpreter start; the ``dsfunc`` launcher sets the variable for every rank, and every process they
start inherits it. So this module costs an interpreter start one small import and nothing more: it imports
only ``os`` and ``sys`` (loaded by then already), and the import machinery it needs only when ``deepspeed``
is imported or ``importlib.metadata`` searches for distributions (which has imported that machinery itself).
"""

import os
import sys

VARIABLE = "DSFUNC_AS_DEEPSPEED"

# The DeepSpeed release whose surface dsfunc answers, marked as dsfunc's by its local label
VERSION = "0.19.8+dsfunc"

_METADATA = f"""Metadata-Version: 2.1
Name: deepspeed
Version: {VERSION}
Summary: dsfunc, answering as DeepSpeed ({VARIABLE}=1)
"""


def enabled(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """Whether the variable asks for the switch: ``1`` on, unset, empty or ``0`` off."""
    value = (os.environ if environ is None else environ).get(VARIABLE, "")
    if value not in ("", "0", "1"):
        print(f"dsfunc: ignoring {VARIABLE}={value!r}: set it to 1 (dsfunc answers as DeepSpeed) or 0",
              file=sys.stderr)
    return value == "1"


class _AsDsfunc:
    """Loads ``deepspeed.X`` as the module ``dsfunc.X`` itself (not a copy); a loader as the import system
    asks for one (``create_module``, ``exec_module``)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: object = None

    def create_module(self, spec: object) -> object:
        import importlib

        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: object) -> None:
        """Nothing to run; the import machinery set the alias's spec on the module: give it its own back."""
        module.__spec__ = self.spec

    def get_code(self, fullname: str) -> object:
        """``dsfunc.X``'s code, for ``python -m deepspeed.X`` (runpy asks the loader for it)."""
        import importlib.util

        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target) if spec is not None and hasattr(spec.loader, "get_code") else None


def _distribution_class() -> type:
    """``deepspeed``'s metadata, answered by dsfunc (a class made when first asked for: it derives from
    ``importlib.metadata.Distribution``, which is imported only by whoever searches distributions)."""
    import importlib.metadata
    import pathlib

    class Distribution(importlib.metadata.Distribution):
        def read_text(self, filename: str) -> str | None:
            return _METADATA if filename == "METADATA" else None

        def locate_file(self, path: object) -> pathlib.Path:
            return pathlib.Path(__file__).parent / str(path)

    return Distribution


class Finder:
    """Answers ``deepspeed`` and ``deepspeed.*`` imports and metadata ahead of any installed DeepSpeed (a
    meta path finder as the import system and ``importlib.metadata`` ask for one)."""

    def __init__(self) -> None:
        self._distribution: type | None = None

    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(fullname, _AsDsfunc("dsfunc" + fullname[len("deepspeed"):]),
                          is_package=not fullname.endswith(".__main__"))  # runpy's rule

    def invalidate_caches(self) -> None:
        """Nothing cached (``importlib.invalidate_caches`` calls this on every meta path finder)."""

    def find_distributions(self, context: object = None) -> list:
        """``deepspeed`` for a search of this interpreter's path (not for tools that scan a given folder, as
        pip does: they must see what is installed there)."""
        name = getattr(context, "name", None)
        if getattr(context, "path", sys.path) is not sys.path:
            return []
        if name is not None and name.lower() != "deepspeed":
            return []
        if self._distribution is None:
            self._distribution = _distribution_class()
        return [self._distribution()]


def install() -> None:
    """Answer as DeepSpeed from now on (idempotent; an already imported real DeepSpeed stays)."""
    if not any(type(f).__name__ == "Finder" and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.insert(0, Finder())


def from_environment() -> None:
    """:func:`install` when the variable is set (what the ``.pth`` file runs)."""
    if enabled():
        install()
