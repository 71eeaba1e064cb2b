"""Frames and buffers of the file tiers: the header check of a put, O_DIRECT alignment, and a
pool of bounce buffers.

O_DIRECT needs the memory address, the file offset and the length of every transfer to be
multiples of the logical block size; 4 KiB covers every NVMe and filesystem we run on. A caller's
frame that is aligned and long enough goes to the disk as is (zero copy); any other frame goes
through a bounce buffer from `BouncePool`. Bounce buffers are private anonymous mmaps
(page-aligned by construction; private, so a forked child never shares one with its parent)
and are reused, because faulting in a fresh 16 MiB mapping costs as much as reading it from a
fast disk.
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np

from kvtier.store.base.block import PAGE, Header, parse_header


def checked_header(key: str, frame: memoryview) -> Header:
    """The header of a frame about to be stored under `key` (ValueError if sealed for another).

    The payload checksum is not recomputed here: the caller sealed the frame (the contract),
    and every read verifies it.
    """
    h = parse_header(frame)
    if h.key != key:
        raise ValueError(f"frame is sealed for {h.key}, not for {key}")
    if len(frame) < h.frame_len:
        raise ValueError(f"frame of {len(frame)} bytes is shorter than its header says "
                         f"({h.frame_len})")
    return h


def address(buf: memoryview) -> int:
    """The address of `buf`'s first byte (works for read-only buffers too)."""
    if len(buf) == 0:
        return 0
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def round_up(n: int, align: int = PAGE) -> int:
    return -(-n // align) * align


def usable_direct(buf: memoryview, nbytes: int) -> bool:
    """True if `buf` can carry an O_DIRECT transfer of `nbytes` (a multiple of PAGE) as is."""
    return len(buf) >= nbytes and address(buf) % PAGE == 0


class BouncePool:
    """Reusable page-aligned buffers, bucketed by power-of-two size (thread-safe).

    At most `keep_bytes` of idle buffers are retained; the rest are unmapped when released.
    """

    def __init__(self, keep_bytes: int = 256 << 20):
        self._keep_bytes = keep_bytes
        self._idle: dict[int, list[memoryview]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @staticmethod
    def _bucket(nbytes: int) -> int:
        return max(PAGE * 16, 1 << (max(nbytes, 1) - 1).bit_length())

    def take(self, nbytes: int) -> memoryview:
        """A page-aligned writable buffer of at least `nbytes` (contents undefined)."""
        size = self._bucket(nbytes)
        with self._lock:
            if self._pid != os.getpid():  # a forked child starts with a pool of its own
                self._pid, self._idle, self._idle_bytes = os.getpid(), {}, 0
            free = self._idle.get(size)
            if free:
                self._idle_bytes -= size
                return free.pop()
        return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))

    def give(self, buf: memoryview) -> None:
        """Return a buffer from `take`; the caller must not use it afterwards."""
        size = len(buf)
        with self._lock:
            if self._pid == os.getpid() and self._idle_bytes + size <= self._keep_bytes:
                self._idle.setdefault(size, []).append(buf)
                self._idle_bytes += size
                return
        buf.release()

    def clear(self) -> None:
        with self._lock:
            idle, self._idle, self._idle_bytes = self._idle, {}, 0
        for bufs in idle.values():
            for buf in bufs:
                buf.release()

    def for_write(self, frame: memoryview, frame_len: int, nbytes: int):
        """(view to write, bounce or None): the frame itself when O_DIRECT can take it."""
        frame = memoryview(frame)
        if usable_direct(frame, nbytes):
            return frame[:nbytes], None
        buf = self.take(nbytes)
        buf[:frame_len] = frame[:frame_len]
        buf[frame_len:nbytes] = bytes(nbytes - frame_len)  # no stale bytes of other blocks
        return buf[:nbytes], buf

    def for_read(self, out: memoryview, nbytes: int):
        """(view to read into, bounce or None): the caller's buffer when O_DIRECT can fill it."""
        out = memoryview(out)
        if usable_direct(out, nbytes):
            return out[:nbytes], None
        buf = self.take(nbytes)
        return buf[:nbytes], buf

    def give_back(self, pairs) -> None:
        """Return the bounces of (view, bounce or None) pairs from `for_write`/`for_read`."""
        for view, bounce in pairs:
            if bounce is not None:
                view.release()
                self.give(bounce)
