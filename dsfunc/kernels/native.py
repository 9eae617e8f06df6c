"""Building and loading the CUDA kernels of ``ops/`` on first use (cached), or saying in one line why not.

The kernels are CUDA C++ built with ``torch.utils.cpp_extension.load`` on first use (cached under
``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) and registered in the private
namespace ``dsfunc_cuda``; the public ops (:mod:`dsfunc.kernels`) forward to them on CUDA tensors. When
no CUDA toolkit, ninja or compiler is present, one line is logged and the plain-torch reference runs
instead (same results, slower).
"""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path

import torch

_log = logging.getLogger("dsfunc.kernels")

OPS_DIR = Path(__file__).resolve().parent.parent.parent / "ops"
_SOURCES = ("register.cpp", "adam.cu", "sum_of_squares.cu")


_native_lock = threading.Lock()
_native_ok: bool | None = None


def _native_unavailable_reason() -> str | None:
    if torch.version.cuda is None:
        return "this torch build has no CUDA support" + (
            " (ROCm is not supported)" if torch.version.hip else ""
        )
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    missing = [s for s in _SOURCES if not (OPS_DIR / s).is_file()]
    if missing:
        return f"kernel sources {missing} not found in {OPS_DIR}"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return f"no CUDA toolkit found (install nvcc for CUDA {torch.version.cuda} or set CUDA_HOME)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _build_native() -> None:
    from torch.utils import cpp_extension

    archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    gencode = [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}" for major, minor in archs]
    with warnings.catch_warnings():
        # cpp_extension's remarks about compiler versions are environment notes, not errors of ours.
        warnings.simplefilter("ignore")
        cpp_extension.load(
            name="dsfunc_ops",
            sources=[str(OPS_DIR / s) for s in _SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", *gencode],
            is_python_module=False,
            verbose=False,
        )


def native_ready() -> bool:
    """Build and load ops/ once per process; on failure log one line and return False."""
    global _native_ok
    if _native_ok is None:
        with _native_lock:
            if _native_ok is None:
                reason = _native_unavailable_reason()
                if reason is None:
                    try:
                        _build_native()
                    except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
                        _log.debug("dsfunc: building ops/ failed:\n%s", exc)
                        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                        reason = f"building {OPS_DIR} failed: {first}"
                if reason is not None:
                    _log.warning(
                        "dsfunc: CUDA kernels unavailable (%s); using the plain-torch reference ops (slower).",
                        reason,
                    )
                _native_ok = reason is None
    return _native_ok


