"""Verification of many frames at once, on every core: what a read of a batch of blocks costs.

Every frame read is verified (`block.verified_len`), and its xxh3-64 is the one per-byte cost
kvtier adds to a transfer. xxh3 runs at 9-35 GB/s on one core on the hosts measured
(`kvtier bench tiers --tiers verify`), and the binding releases the GIL while it hashes a
large buffer, so frames of `PARALLEL_MIN_BYTES` and more are verified on a pool of threads
(one per core, at most `MAX_THREADS`): a batch of 2 MiB frames
checks 1.9x faster on two cores, and on a 16-core host the checksum stops bounding a hit.
Smaller frames are checked in the calling thread: for 256 KiB and less the binding keeps
the GIL, and threads only fight over it (measured: 0.5x at 256 KiB, 0.13x at 32 KiB).

Frames a reader copies itself (out of a segment file of its node) are copied and checked by
the same pool thread, one frame each (`copied_verified_lens`): the copy lets go of the GIL
too, so a batch moves and is checked on every core, and each check reads a frame the core
that checks it has just written (on a 2-core Intel VM, 64 x 2 MiB: 1.5x the rate of copying
and checking them one after the other, against 1.2x for copies in the caller and checks on
the pool).

The pool is per process (a child after fork builds its own) and started on first use.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from kvtier.store.base.block import buffer_address, verified_len
from kvtier.store.base.errors import CorruptBlockError

PARALLEL_MIN_BYTES = 1 << 20
MAX_THREADS = 16
_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool)


def threads() -> int:
    """How many threads verify a batch on this host."""
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(threads(),
                                                     thread_name_prefix="kvtier-verify"))
        return _pool[1]


def _one(frame: memoryview, key: str, length: int) -> int | None:
    try:
        return verified_len(frame, key, length)
    except CorruptBlockError:
        return None


def verified_lens(frames: Sequence[memoryview], keys: Sequence[str],
                  lengths: Sequence[int]) -> list[int | None]:
    """`verified_len` of each frame (its payload length), None where it fails verification;
    large frames in parallel."""
    n = len(frames)
    if n < 2 or threads() < 2 or min(lengths, default=0) < PARALLEL_MIN_BYTES:
        return [_one(f, k, m) for f, k, m in zip(frames, keys, lengths)]
    return list(_executor().map(_one, frames, keys, lengths))


def _copied(dst: memoryview, src: memoryview, key: str) -> int | None:
    n = len(src)
    # ctypes releases the GIL for the copy; `src` (a view of its mapping) is held meanwhile,
    # so the mapping cannot be closed under it
    ctypes.memmove(buffer_address(dst), buffer_address(src), n)
    return _one(dst[:n], key, n)


def copied_verified_lens(dsts: Sequence[memoryview], srcs: Sequence[memoryview],
                         keys: Sequence[str]) -> list[int | None]:
    """Copy each frame in `srcs` to the start of its buffer in `dsts` (each at least as long)
    and verify it there: `verified_len` of each, None where it fails verification. Large
    frames in parallel, each copied and then checked by one thread while still in its core's
    cache."""
    n = len(srcs)
    if n < 2 or threads() < 2 or min(map(len, srcs), default=0) < PARALLEL_MIN_BYTES:
        out: list[int | None] = []
        for dst, src, key in zip(dsts, srcs, keys):
            dst[:len(src)] = src
            out.append(_one(dst[:len(src)], key, len(src)))
        return out
    return list(_executor().map(_copied, dsts, srcs, keys))
