"""Host buffers page-locked at their exact size, for ZeRO-Offload (:mod:`dsfunc.zero.offload`) and the checkpointed
inputs of ``cpu_checkpointing`` (:mod:`dsfunc.activation_offload`).

Only the buffers that take part in copies with the GPU are pinned (the masters and moments are read by the host
alone), and they are pinned at their exact size with ``cudaHostRegister``: torch's pinned allocator
(``pin_memory=True``) rounds every allocation up to a power of two, 1.6x the bytes for a unit of 79M parameters.
"""

from __future__ import annotations

import logging
import weakref

import torch

logger = logging.getLogger("dsfunc")


class PinnedAllocator:
    """Host tensors page-locked at their exact size, unlocked when released or when their owner goes."""

    def __init__(self, owner: object) -> None:
        # each registered buffer by address, kept here until released or unregistered: freed while still
        # registered (its holder gone before the owner), its pages would make a later registration there fail
        # with cudaErrorHostMemoryAlreadyRegistered, an error the next kernel launch then raises
        self.registered: dict[int, torch.Tensor] = {}
        self.failed = False
        weakref.finalize(owner, PinnedAllocator._unregister_all, self.registered)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        if self.failed or out.numel() == 0:
            return out
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(out.data_ptr(), out.numel() * out.element_size(), 0)) != 0:
            self.failed = True  # e.g. the locked-memory limit (ulimit -l): pageable copies are slower, not wrong
            logger.warning("offload: page-locking %d host bytes failed; host buffers stay pageable", out.nbytes)
            return out
        self.registered[out.data_ptr()] = out
        return out

    def release(self, tensor: torch.Tensor) -> None:
        """Unlock ``tensor`` before it is dropped, once the device is done with it."""
        if tensor.data_ptr() in self.registered:
            torch.cuda.synchronize()  # a non-blocking copy into or out of it may still be in flight
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
            del self.registered[tensor.data_ptr()]

    @staticmethod
    def _unregister_all(registered: dict[int, torch.Tensor]) -> None:
        # Runs as the owner goes. A buffer that outlives it is pageable memory from then on: copies with it
        # are synchronous, still correct.
        if registered:
            torch.cuda.synchronize()
        for ptr in registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        registered.clear()


class HostMemory:
    """Where the offload's host buffers come from: pinned when the compute device is a GPU and pinning is on."""

    def __init__(self, pin: bool) -> None:
        self.pinned = PinnedAllocator(self) if pin else None

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for copies with the compute device."""
        return torch.empty(numel, dtype=dtype) if self.pinned is None else self.pinned.empty(numel, dtype)

    def release(self, tensor: torch.Tensor) -> None:
        """Unlock ``tensor`` (if pinned) before it is dropped."""
        if self.pinned is not None:
            self.pinned.release(tensor)
