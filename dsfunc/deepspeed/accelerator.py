"""``deepspeed.accelerator``: ``get_accelerator()``, the device calls scripts make, for CUDA or the CPU.

DeepSpeed scripts ask its accelerator object for the device instead of calling ``torch.cuda``::

    from deepspeed.accelerator import get_accelerator
    device = torch.device(get_accelerator().device_name(args.local_rank))
    get_accelerator().set_device(args.local_rank)
    print(get_accelerator().max_memory_allocated() / 2**30)

Here there are two accelerators, as the engine has two devices: CUDA when ``torch.cuda.is_available()``
(the calls are ``torch.cuda``'s), else the CPU (DeepSpeed's CPU accelerator: synchronisation and caches
are no-ops, memory is the process's resident set, the backend is gloo). Graph capture, pinned-memory
registration and DeepSpeed's op builders are not provided; they raise at the call.
"""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Any

import torch

from dsfunc.errors import NotSupportedError


class Accelerator:
    """DeepSpeed's ``DeepSpeedAccelerator`` for one device type (``"cuda"`` or ``"cpu"``)."""

    def __init__(self, kind: str) -> None:
        self._name = kind
        self._communication_backend_name = "nccl" if kind == "cuda" else "gloo"
        self._cuda = torch.cuda if kind == "cuda" else None
        self._peak = 0

    # -- devices ----------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        if self._cuda is None or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        return self._cuda.device(device_index) if self._cuda is not None else None

    def set_device(self, device_index: int) -> None:
        if self._cuda is not None:
            self._cuda.set_device(device_index)

    def current_device(self) -> int:
        return self._cuda.current_device() if self._cuda is not None else int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return f"cuda:{self._cuda.current_device()}" if self._cuda is not None else "cpu"

    def device_count(self) -> int:
        if self._cuda is not None:
            return self._cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda is not None:
            self._cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        return self._cuda is None

    def use_host_timers(self) -> bool:
        return self._cuda is None

    def resolves_data_dependency(self) -> bool:
        return self._cuda is None

    def handles_memory_backpressure(self) -> bool:
        return self._cuda is None

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        return False

    def get_compile_backend(self) -> str:
        return "inductor"

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda is not None else []

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._cuda is not None else []

    # -- random numbers ---------------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        (self._cuda.manual_seed if self._cuda is not None else torch.manual_seed)(seed)

    def manual_seed_all(self, seed: int) -> None:
        (self._cuda.manual_seed_all if self._cuda is not None else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return self._cuda.initial_seed() if self._cuda is not None else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda is None:
            return torch.get_rng_state()
        return self._cuda.get_rng_state() if device_index is None else self._cuda.get_rng_state(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda is None:
            torch.set_rng_state(new_state)
        elif device_index is None:
            self._cuda.set_rng_state(new_state)
        else:
            self._cuda.set_rng_state(new_state, device_index)

    @property
    def default_generator(self) -> Any:
        return torch.cuda.default_generators if self._cuda is not None else torch.default_generator

    # -- streams and events (the CPU has one implicit stream) ---------------------------------------
    @property
    def Stream(self) -> Any:
        return self._cuda.Stream if self._cuda is not None else _NoStream

    def stream(self, stream: Any) -> Any:
        return self._cuda.stream(stream) if self._cuda is not None else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return self._cuda.current_stream(device_index) if self._cuda is not None else _NoStream()

    def default_stream(self, device_index: int | None = None) -> Any:
        return self._cuda.default_stream(device_index) if self._cuda is not None else _NoStream()

    @property
    def Event(self) -> Any:
        return self._cuda.Event if self._cuda is not None else _NoEvent

    def range_push(self, msg: str) -> None:
        if self._cuda is not None:
            self._cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda is not None:
            self._cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> None:
        if self._cuda is not None:
            self._cuda._lazy_call(callback)
        else:
            callback()

    # -- memory -----------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda is not None:
            self._cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda is not None:
            return self._cuda.memory_allocated(device_index)
        rss = _rss()
        self._peak = max(self._peak, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda is not None:
            return self._cuda.max_memory_allocated(device_index)
        return max(self._peak, self.memory_allocated())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda is not None:
            self._cuda.reset_peak_memory_stats(device_index)
        self._peak = 0

    reset_max_memory_allocated = reset_peak_memory_stats
    reset_max_memory_cached = reset_peak_memory_stats

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._cuda.memory_reserved(device_index) if self._cuda is not None else self.memory_allocated()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._cuda.max_memory_reserved(device_index) if self._cuda is not None else self.max_memory_allocated()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._cuda is not None:
            return self._cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda is not None:
            return self._cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda is not None:
            return self._cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # -- data types and tensors -------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return self._cuda.is_bf16_supported() if self._cuda is not None else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda is not None else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def _tensor_type(self, dtype: torch.dtype) -> Any:
        return lambda *args, **kwargs: torch.tensor(*args, dtype=dtype, device=self._name, **kwargs)

    @property
    def BFloat16Tensor(self) -> Any:
        return self._tensor_type(torch.bfloat16)

    @property
    def HalfTensor(self) -> Any:
        return self._tensor_type(torch.float16)

    @property
    def FloatTensor(self) -> Any:
        return self._tensor_type(torch.float32)

    @property
    def DoubleTensor(self) -> Any:
        return self._tensor_type(torch.float64)

    @property
    def IntTensor(self) -> Any:
        return self._tensor_type(torch.int32)

    @property
    def LongTensor(self) -> Any:
        return self._tensor_type(torch.int64)

    @property
    def ByteTensor(self) -> Any:
        return self._tensor_type(torch.uint8)

    # -- what dsfunc does not provide -------------------------------------------------------------
    def create_op_builder(self, class_name: str) -> Any:
        raise NotSupportedError(f"get_accelerator().create_op_builder({class_name!r}): DeepSpeed's op builders are not "
                                "part of dsfunc (its kernels build on first use; see dsfunc.kernels)")

    get_op_builder = create_op_builder

    def create_graph(self) -> Any:
        raise NotSupportedError("get_accelerator().create_graph(): graph capture is not provided by dsfunc")

    capture_to_graph = replay_graph = create_graph


class _NoStream:
    """The CPU's one implicit stream."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to order."""

    def __enter__(self) -> _NoStream:  # noqa: PYI034 - a private class, never subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _NoEvent:
    """An event on the CPU: every recorded point is already reached."""

    def __init__(self, **kwargs: Any) -> None:
        self._time: float = 0.0

    def record(self, stream: Any = None) -> None:
        import time

        self._time = time.perf_counter()

    def synchronize(self) -> None:
        """Already reached."""

    def wait(self, stream: Any = None) -> None:
        """Already reached."""

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _NoEvent) -> float:
        return (end._time - self._time) * 1000


def _rss() -> int:
    """This process's resident set in bytes (its peak when psutil is not installed)."""
    try:
        import psutil
    except ImportError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return psutil.Process().memory_info().rss


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator of this process: CUDA when available, else the CPU (``DS_ACCELERATOR`` picks one)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        wanted = os.environ.get("DS_ACCELERATOR")
        if wanted not in (None, "cuda", "cpu"):
            raise NotSupportedError(f"DS_ACCELERATOR={wanted!r}: dsfunc runs on 'cuda' or 'cpu'")
        if wanted == "cuda" and not torch.cuda.is_available():
            raise NotSupportedError("DS_ACCELERATOR=cuda, but torch sees no CUDA device")
        _ACCELERATOR = Accelerator(wanted or ("cuda" if torch.cuda.is_available() else "cpu"))
    return _ACCELERATOR


def is_current_accelerator_supported() -> bool:
    """Whether this process's accelerator is one DeepSpeed supports (dsfunc's two always are)."""
    return get_accelerator().device_name() in ("cuda", "cpu")


def set_accelerator(accelerator: Accelerator) -> None:
    """Use ``accelerator`` from now on (DeepSpeed's ``set_accelerator``)."""
    global _ACCELERATOR
    _ACCELERATOR = accelerator
