"""The checksum every read pays, on its own: `kvtier bench tiers`' verification rows.

For each block size, a batch of sealed frames (64, within `max_batch_bytes`) is verified
round after round: by `block.verified_len` one frame after another in one thread (what a
read costs a core), and by `verify_pool.verified_lens` (frames of 1 MiB and more spread over
every core). GB/s is payload per second of the median round; `per_core_gbps` in extra is
payload per second of the calling thread's CPU time in the one-thread rows, the per-core
speed of the hash whatever else the machine runs.
"""

from __future__ import annotations

import time

from kvtier.store.base import block
from kvtier.store.base import verify_pool
from kvtier.store.base.keys import NS_HEX
from kvtier.tools.bench.report import Row, row_from_times

BATCH = 64


def checksum_rows(sizes, max_batch_bytes: int, rounds: int = 5) -> list[Row]:
    """One-thread and pool rows per block size (reference rows of the bench)."""
    out = []
    for size in sizes:
        n = max(1, min(BATCH, max_batch_bytes // size))
        stride = block.frame_size(size, block.PAGE)
        buf = block.alloc_aligned(n * stride)
        keys = [f"{'0' * NS_HEX}{i:032x}" for i in range(n)]
        frames = [buf[i * stride:i * stride + block.HEADER_SIZE + size] for i in range(n)]
        for key, frame in zip(keys, frames):
            block.seal(frame, key, size)
        lens = [len(f) for f in frames]
        one, pool, cpu = [], [], []
        for _ in range(rounds):
            t0, c0 = time.perf_counter(), time.thread_time()
            assert all(block.verified_len(f, k, m) == size for f, k, m in zip(frames, keys, lens))
            one.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            t0 = time.perf_counter()
            assert verify_pool.verified_lens(frames, keys, lens) == [size] * n
            pool.append(time.perf_counter() - t0)
        row = row_from_times("xxh3 verify, 1 thread", "reference", "verify", size, n, one)
        row.extra["per_core_gbps"] = round(size * n * rounds / sum(cpu) / 1e9, 2)
        out.append(row)
        prow = row_from_times(f"xxh3 verify, {verify_pool.threads()} threads", "reference",
                              "verify", size, n, pool)
        prow.extra["threads"] = verify_pool.threads()
        prow.extra["scaling"] = round(row.p50_ms / prow.p50_ms, 2)
        out.append(prow)
    return out
