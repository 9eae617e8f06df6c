"""Building and loading the C++ kernels of ``ops/`` on first use (cached), or saying in one line why not.

Two builds, each made with ``torch.utils.cpp_extension.load`` the first time a process needs it (cached
under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``):

* ``"cuda"``: the CUDA kernels, registered in the private namespace ``dsfunc_cuda``; the public ops
  (:mod:`dsfunc.kernels`) forward to them on CUDA tensors;
* ``"cpu"``: the host Adam of ZeRO-Offload (``ops/adam_cpu.cpp``, namespace ``dsfunc_cpu``: fp32 masters and
  moments, and the bf16 chain's case of :mod:`dsfunc.optim.low_precision_host`), compiled for
  this machine's CPU (``-march=native``: a cache shared between machines of different CPUs needs one
  ``TORCH_EXTENSIONS_DIR`` each).

When a build cannot be made (no CUDA toolkit, no compiler, no ninja) one line is logged and the plain-torch
reference runs instead (same results to an ulp, slower). A build directory's ``lock`` file means another process
is building; torch waits for it with no end, so a build killed midway (its lock left behind) would hang every
later process silently: dsfunc waits for a lock only while it is younger than :data:`STALE_LOCK_S`, and names
the file to delete once it is older. torch takes the lock for a moment on every load, cached or not, so the wait is
announced only once it has lasted :data:`ANNOUNCE_AFTER_S`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from pathlib import Path

import torch

_log = logging.getLogger("dsfunc.kernels")

OPS_DIR = Path(__file__).resolve().parent.parent.parent / "ops"


@dataclasses.dataclass(frozen=True)
class _Build:
    name: str
    sources: tuple[str, ...]
    what: str  # for the log line


_BUILDS = {
    "cuda": _Build("dsfunc_ops",
                   ("register.cpp", "adam.cu", "sum_of_squares.cu", "cross_entropy.cu", "step_scalars.cu"),
                   "CUDA kernels"),
    "cpu": _Build("dsfunc_cpu_ops", ("adam_cpu.cpp",), "CPU kernels"),
}
# -ffp-contract=off: no fused multiply-add beyond the ones adam_math.h writes (the CUDA kernel's rounding);
# -fno-math-errno lets sqrt vectorise (errno is never read); -fopenmp: at::parallel_for is a header template.
# Not linked with -fopenmp: its OpenMP calls resolve to torch's own runtime (a wheel bundles one), so the
# threads are torch's and torch.set_num_threads counts them.
_CPU_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]

STALE_LOCK_S = 900.0  # a lock older than this is a killed build's: these builds take a few minutes
ANNOUNCE_AFTER_S = 5.0  # a load of a cached build holds the lock for well under this

_lock = threading.Lock()
_ready: dict[str, bool] = {}


def _unavailable_reason(kind: str) -> str | None:
    if kind == "cuda":
        if torch.version.cuda is None:
            return "this torch build has no CUDA support" + (" (ROCm is not supported)" if torch.version.hip else "")
        if not torch.cuda.is_available():
            return "no CUDA device is visible"
    missing = [s for s in _BUILDS[kind].sources if not (OPS_DIR / s).is_file()]
    if missing:
        return f"kernel sources {missing} not found in {OPS_DIR}"
    from torch.utils import cpp_extension

    if kind == "cuda" and cpp_extension.CUDA_HOME is None:
        return f"no CUDA toolkit found (install nvcc for CUDA {torch.version.cuda} or set CUDA_HOME)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _stale_lock(kind: str) -> str | None:
    """Wait while another process holds the build's lock; the reason not to build if the lock is stale."""
    from torch.utils import cpp_extension

    lock = Path(cpp_extension._get_build_directory(_BUILDS[kind].name, verbose=False)) / "lock"
    started, announced = time.monotonic(), False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return None
        if age > STALE_LOCK_S:
            return (f"the build lock {lock} is {age / 60:.0f} minutes old, left by a build that was stopped midway "
                    f"(delete it if no other process is building: rm {lock})")
        if not announced and time.monotonic() - started >= ANNOUNCE_AFTER_S:
            _log.warning("dsfunc: waiting for another process's build of the %s (lock %s)",
                         _BUILDS[kind].what, lock)
            announced = True
        time.sleep(1.0)


def _build(kind: str) -> None:
    from torch.utils import cpp_extension

    build = _BUILDS[kind]
    if kind == "cuda":
        archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        gencode = [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}" for major, minor in archs]
        flags = {"extra_cflags": ["-O3"], "extra_cuda_cflags": ["-O3", *gencode]}
    else:
        flags = {"extra_cflags": _CPU_FLAGS}
    with warnings.catch_warnings():
        # cpp_extension's remarks about compiler versions are environment notes, not errors of ours.
        warnings.simplefilter("ignore")
        cpp_extension.load(name=build.name, sources=[str(OPS_DIR / s) for s in build.sources],
                           is_python_module=False, verbose=False, **flags)


def native_ready(kind: str = "cuda") -> bool:
    """Build and load the ``kind`` ("cuda" or "cpu") kernels of ops/ once per process; on failure log one line
    and return False."""
    if kind not in _ready:
        with _lock:
            if kind not in _ready:
                reason = _unavailable_reason(kind) or _stale_lock(kind)
                if reason is None:
                    try:
                        _build(kind)
                    except Exception as exc:  # noqa: BLE001 - any build failure means: use the reference
                        _log.debug("dsfunc: building ops/ (%s) failed:\n%s", kind, exc)
                        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                        reason = f"building {OPS_DIR} failed: {first}"
                if reason is not None:
                    _log.warning("dsfunc: %s unavailable (%s); using the plain-torch reference ops (slower).",
                                 _BUILDS[kind].what, reason)
                _ready[kind] = reason is None
    return _ready[kind]
