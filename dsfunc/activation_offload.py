"""Checkpointed inputs in pinned host memory: copied out while the forward goes on, prefetched back for backward.

With ``cpu_checkpointing`` on a GPU, each checkpointed call's saved inputs (what non-reentrant
``torch.utils.checkpoint`` saves under the saved-tensor hooks around it; everything its recomputation saves stays
under the checkpoint's own inner hooks) leave the device. ``torch.autograd.graph.save_on_cpu`` did this with three
faults that long sequences expose (one input of an 8B Llama at 256K tokens is 2 GiB): its copy out blocks the host,
its copy back runs on the compute stream when the recomputation needs it, and torch's pinned allocator rounds each
buffer up to a power of two. Here:

* a tensor of at least ``min_bytes`` on the device is copied out on a copy stream of its own, after the work that
  made it, into a host buffer of its exact size (:class:`dsfunc.pinned.HostMemory`, page-locked with
  ``cudaHostRegister``) from a pool that later steps reuse; smaller tensors (masks, RoPE tables) stay as they are;
* [Note: checkpoint prefetch] backward reaches the checkpointed calls in the reverse of their forward order, so when
  a call's inputs are first unpacked (its backward begins) the inputs of the call made just before it start their
  copy back on the copy stream, overlapping this call's recomputation and backward; the compute stream waits for a
  copy only where it uses it. Where several micro-batches' forwards precede one backward (the backward by units of
  ``offload_optimizer.micro_batches_per_backward``), each call still precedes the one before it in its own
  micro-batch: the first call of each micro-batch's backward copies back unprefetched, every later one is ready
  (there the offload frees no GPU memory yet: the backward by units keeps each cut unit input, and its detached
  leaf, on the device for its segments);
* a host buffer goes back to the pool when its call's checkpoint is dropped (its backward done, or the graph freed
  unused); the pool keeps at most the most bytes ever in use at once (one step's need), releasing the rest.

Copies into and out of the pool's buffers all run on the one copy stream, so a buffer taken again is written only
after the copy that read it. The same hooks run with a non-CUDA ``device_type`` (copies are then synchronous),
which is how the bookkeeping is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

from dsfunc.pinned import HostMemory

MIN_BYTES = 2**20


class ActivationOffloader:
    """The saved-tensor hooks of checkpointed calls whose inputs live in host memory; one per model.

    ``prefetched`` and ``consumed`` count the copies back started ahead and the ones used (equal once every
    checkpointed call has run its backward); ``pool`` holds the host buffers.
    """

    def __init__(self, device_type: str = "cuda", min_bytes: int = MIN_BYTES) -> None:
        self.device_type = device_type
        self.min_bytes = min_bytes
        self.pool = HostPool(HostMemory(pin=device_type == "cuda"))
        self.prefetched = 0
        self.consumed = 0
        self._streams: dict[torch.device, _CopyStream] = {}
        self._last: weakref.ref[_Checkpoint] | None = None

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Around one checkpointed call: the tensors saved inside are its inputs, offloaded together."""
        checkpoint = _Checkpoint(self._last)
        self._last = weakref.ref(checkpoint)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(checkpoint, t), self._unpack):
            yield

    def _pack(self, checkpoint: _Checkpoint, tensor: torch.Tensor) -> torch.Tensor | _HostCopy:
        nbytes = tensor.numel() * tensor.element_size()
        if (type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.device.type != self.device_type
                or nbytes < self.min_bytes):
            return tensor
        buffer = self.pool.take(nbytes)
        host = buffer.view(tensor.dtype).view(tensor.shape)
        stream = self._stream(tensor.device)
        if stream is None:
            host.copy_(tensor)
        else:
            stream.to_host(tensor, host)
        copy = _HostCopy(checkpoint, host, tensor.device)
        weakref.finalize(copy, self.pool.give, buffer)
        checkpoint.copies.append(weakref.ref(copy))
        return copy

    def _unpack(self, saved: torch.Tensor | _HostCopy) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        checkpoint = saved.checkpoint
        if not checkpoint.begun:  # its backward begins: bring back the inputs the next one will need
            checkpoint.begun = True
            before = checkpoint.before() if checkpoint.before is not None else None
            if before is not None and not before.begun and not before.fetched:
                self._prefetch(before)
        if saved.ready is not None:
            tensor, event = saved.ready
            saved.ready = None
            self.consumed += 1
        else:
            tensor, event = self._to_device(saved)
        if event is not None:
            torch.cuda.current_stream(tensor.device).wait_event(event)
        return tensor

    def _prefetch(self, checkpoint: _Checkpoint) -> None:
        checkpoint.fetched = True
        for ref in checkpoint.copies:
            copy = ref()
            if copy is not None:
                copy.ready = self._to_device(copy)
                self.prefetched += 1

    def _to_device(self, copy: _HostCopy) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        stream = self._stream(copy.device)
        if stream is None:
            return copy.host.to(copy.device, copy=True), None
        return stream.to_device(copy.host, copy.device)

    def _stream(self, device: torch.device) -> _CopyStream | None:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = _CopyStream(device)
        return self._streams[device]


class HostPool:
    """Host buffers (bytes) by their exact size, taken and given back; at most the most bytes ever in use at once
    are kept, so a change of shapes releases the old sizes instead of growing."""

    def __init__(self, memory: HostMemory) -> None:
        self.memory = memory
        self.free: dict[int, list[torch.Tensor]] = {}
        self.in_use = 0
        self.peak = 0
        self._lock = threading.Lock()  # buffers come back from the backward's thread and the garbage collector

    @property
    def held(self) -> int:
        """Bytes the pool holds, in use or free."""
        with self._lock:
            return self.in_use + sum(n * len(bufs) for n, bufs in self.free.items())

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self.free.get(nbytes)
            buffer = free.pop() if free else None
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
        if buffer is None:
            buffer = self.memory.empty(nbytes, torch.uint8)
            self._trim()
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self.in_use -= buffer.numel()
            self.free.setdefault(buffer.numel(), []).append(buffer)

    def _trim(self) -> None:
        released = []
        with self._lock:
            excess = self.in_use + sum(n * len(b) for n, b in self.free.items()) - self.peak
            for n in sorted(self.free):
                while excess > 0 and self.free[n]:
                    released.append(self.free[n].pop())
                    excess -= n
        for buffer in released:
            self.memory.release(buffer)


class _Checkpoint:
    """One checkpointed call's offloaded inputs, and the call made before it (the one backward reaches next)."""

    def __init__(self, before: weakref.ref[_Checkpoint] | None) -> None:
        self.before = before
        self.copies: list[weakref.ref[_HostCopy]] = []
        self.begun = False  # its inputs were unpacked: its backward began
        self.fetched = False  # its copies back were started ahead


class _HostCopy:
    """A saved tensor's copy in a pool buffer, and its copy back once prefetched (with the event that ends it)."""

    def __init__(self, checkpoint: _Checkpoint, host: torch.Tensor, device: torch.device) -> None:
        self.checkpoint = checkpoint
        self.host = host
        self.device = device
        self.ready: tuple[torch.Tensor, torch.cuda.Event | None] | None = None


class _CopyStream:
    """The CUDA stream that copies checkpoints between a device and the host, beside the compute stream."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    def to_host(self, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))  # after the work that made it
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # its memory is not reused before the copy ends

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
        compute = torch.cuda.current_stream(device)
        out = torch.empty(host.shape, dtype=host.dtype, device=device)  # the compute stream's memory
        self.stream.wait_stream(compute)  # its last readers (earlier work there) are done before the copy writes
        with torch.cuda.stream(self.stream):
            out.copy_(host, non_blocking=True)
        out.record_stream(self.stream)  # dropped unconsumed, it is not reused before the copy ends
        return out, self.stream.record_event()
