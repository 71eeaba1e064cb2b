"""Staging frame buffers between the paged KV cache and the store.

A `FrameBuffer` holds up to `capacity` frames of `stride` bytes each, back to back; frame i
is `host[i*stride:(i+1)*stride]`, its payload at offset `block.HEADER_SIZE`. Frames are page
aligned (`stride` is a multiple of 4 KiB and the buffer starts on a page), so tiers may use
O_DIRECT on them. On CPU the host buffer is what gather/scatter touch. On CUDA the host
buffer is pinned, and a device mirror of the same size takes the gather/scatter; one bulk
copy moves the whole mirror, headers and all (the fastest way across PCIe: DESIGN.md).

`StagingPool` bounds the memory in flight. The caller guarantees it releases every buffer it
acquires; `acquire` blocks while all are taken, up to its caller's bound (backpressure on
saves: the worker drops saves only when none has freed a buffer in a second).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, Sequence

import torch

from kvtier.store.base import block

PAGE = block.PAGE


class FrameBuffer:
    """`capacity` frames of `stride` bytes on the host (and its device mirror on CUDA)."""

    def __init__(self, capacity: int, stride: int, device: torch.device,
                 alloc: Callable[[int], memoryview] | None = None):
        if stride % PAGE:
            raise ValueError(f"frame stride {stride} is not a multiple of {PAGE}")
        self.capacity = capacity
        self.stride = stride
        nbytes = capacity * stride
        if device.type == "cuda":
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._mv = memoryview(self.host.numpy())
            self.device_view = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            # `alloc`: memory a tier moves frames through without a copy (a pool service's
            # shared memory); it must be page aligned like alloc_aligned's.
            self._mv = (alloc or block.alloc_aligned)(nbytes)
            self.host = torch.frombuffer(self._mv, dtype=torch.uint8, count=nbytes)
            self.device_view = self.host

    @property
    def memory(self) -> memoryview:
        """The whole host buffer (to register it with a tier for zero-copy transfers)."""
        return self._mv

    def frame(self, i: int) -> memoryview:
        """Frame i of the host buffer (writable, page aligned)."""
        return self._mv[i * self.stride:(i + 1) * self.stride]

    def populate(self) -> None:
        """Map in every page of the host buffer now, so its first use pays no page faults
        (pinned CUDA memory is mapped in when it is pinned)."""
        if self.mirrored:
            return
        if not block.populate(self.host.data_ptr(), self.host.numel(), write=True):
            self.host[::PAGE] = 0  # an older kernel: one write per page (the buffer is unused)

    @property
    def mirrored(self) -> bool:
        return self.device_view is not self.host

    def to_host(self, n: int, non_blocking: bool = True) -> None:
        """Copy the first `n` frames device -> host (one bulk copy; CUDA only)."""
        if self.mirrored:
            self.host[: n * self.stride].copy_(self.device_view[: n * self.stride],
                                               non_blocking=non_blocking)

    def to_device(self, n: int, non_blocking: bool = True) -> None:
        """Copy the first `n` frames host -> device (one bulk copy; CUDA only)."""
        if self.mirrored:
            self.device_view[: n * self.stride].copy_(self.host[: n * self.stride],
                                                      non_blocking=non_blocking)


class StagingPool:
    """At most `max_buffers` frame buffers, created on first use and reused."""

    def __init__(self, capacity: int, stride: int, device: torch.device, max_buffers: int,
                 on_new: Callable[[FrameBuffer], None] | None = None,
                 alloc: Callable[[int], memoryview] | None = None):
        self.capacity = capacity
        self.alloc = alloc  # host memory for CPU buffers (FrameBuffer's `alloc`)
        self.stride = stride
        self.device = device
        self.max_buffers = max_buffers
        self.on_new = on_new  # called once per buffer created (e.g. to register it)
        self._free: list[FrameBuffer] = []
        self._created = 0
        self._cond = threading.Condition()

    def acquire(self, timeout_s: float | None = None) -> FrameBuffer | None:
        """A free buffer; waits while all `max_buffers` are in use, at most `timeout_s`
        (then None)."""
        with self._cond:
            if not self._cond.wait_for(self._room, timeout_s):
                return None
            if self._free:
                return self._free.pop()
            self._created += 1
        return self._new()

    def warm(self, n: int) -> int:
        """Make up to `n` buffers now, their pages mapped in and `on_new` run (a tier's
        registration), so the first saves and loads do not pay for either; returns how
        many it made. Meant for a thread of its own at start: an `acquire` meanwhile takes
        a free buffer, makes another within `max_buffers`, or waits for one being made."""
        made = 0
        for _ in range(n):
            with self._cond:
                if self._created >= self.max_buffers:
                    break
                self._created += 1
            buf = self._new()
            try:
                buf.populate()
            finally:  # mapped in or not, the buffer is there to use
                self.release(buf)
            made += 1
        return made

    def _new(self) -> FrameBuffer:
        """A new buffer for a slot already counted in `_created` (given back if it fails)."""
        try:
            buf = FrameBuffer(self.capacity, self.stride, self.device, self.alloc)
            if self.on_new is not None:
                self.on_new(buf)
            return buf
        except BaseException:
            with self._cond:
                self._created -= 1
                self._cond.notify()
            raise

    def release(self, buf: FrameBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def release_after(self, buf: FrameBuffer, pending: Sequence[Future]) -> None:
        """Release `buf` once every transfer still writing into it is done (a load that
        passed its deadline leaves its transfer running: the buffer stays out of use)."""
        left = [len(pending)]
        lock = threading.Lock()

        def one_done(_fut) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.release(buf)
        if not pending:
            self.release(buf)
        for fut in pending:
            fut.add_done_callback(one_done)

    def has_room(self) -> bool:
        """Would `acquire` return at once (a buffer free, or one more may be made)?"""
        with self._cond:
            return self._room()

    def _room(self) -> bool:
        """What `acquire` waits for; the caller holds `_cond`."""
        return bool(self._free) or self._created < self.max_buffers

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._created - len(self._free)
