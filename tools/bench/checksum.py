"""The checksum every read pays, on its own: `kvtier bench tiers`' verification rows.

For each block size, a batch of sealed frames (64, within `max_batch_bytes`) is verified
round after round: by `block.verified_len` one frame after another in one thread (what a
read costs a core), and by `verify_pool.verified_lens` (frames of 1 MiB and more spread over
every core). GB/s is payload per second of the median round; `per_core_gbps` in extra is
payload per second of the calling thread's CPU time in the one-thread rows, the per-core
speed of the hash whatever else the machine runs.

`hash_rows` rates the hashes a frame's checksum could be, on frames built alike, so the choice
of xxh3-64 stays a measurement: the hash alone, one thread (CRC32C where the `crc32c`
package is installed, BLAKE3 where `blake3` is, zlib's CRC-32), and BLAKE3's own
multi-threaded mode, the one candidate that can split a single frame over cores
(`per_core_gbps` over the process's CPU time there). None of them is a dependency of kvtier:
a candidate not installed is skipped and named.
"""

from __future__ import annotations

import importlib
import time
import zlib
from typing import Callable

from kvtier.store.base import block
from kvtier.store.base import verify_pool
from kvtier.store.base.keys import NS_HEX
from kvtier.tools.bench.report import Row, row_from_times

BATCH = 64
Hash = Callable[[memoryview], object]


def _optional(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def hash_candidates() -> tuple[dict[str, tuple[Hash, bool]], list[str]]:
    """{name: (hash of a payload, whether it runs on several threads)} of the candidates
    installed here, and a line for each one that is not."""
    got: dict[str, tuple[Hash, bool]] = {"xxh3-64 hash": (block.payload_checksum, False),
                                         "crc32 (zlib) hash": (zlib.crc32, False)}
    missing = []
    crc32c = _optional("crc32c")
    if crc32c is not None:
        got["crc32c hash"] = (crc32c.crc32c, False)
    else:
        missing.append("crc32c: not installed (pip install crc32c to rate it)")
    blake3 = _optional("blake3")
    if blake3 is not None:
        got["blake3 hash"] = (lambda b: blake3.blake3(b).digest(), False)
        got["blake3 hash, threads per frame"] = (
            lambda b: blake3.blake3(b, max_threads=blake3.blake3.AUTO).digest(), True)
    else:
        missing.append("blake3: not installed (pip install blake3 to rate it)")
    return got, missing


def hash_rows(sizes, max_batch_bytes: int, rounds: int = 5) -> tuple[list[Row], list[str]]:
    """One row per installed candidate and block size: the payloads of a batch built as
    `checksum_rows`' is, hashed one after another; and the lines naming the candidates
    skipped."""
    cands, missing = hash_candidates()
    out = []
    for size in sizes:
        _, frames = _sealed_batch(size, max_batch_bytes)
        payloads = [f[block.HEADER_SIZE:] for f in frames]
        for name, (fn, threaded) in cands.items():
            clock = time.process_time if threaded else time.thread_time
            times, cpu = [], 0.0
            for _ in range(rounds):
                t0, c0 = time.perf_counter(), clock()
                for p in payloads:
                    fn(p)
                times.append(time.perf_counter() - t0)
                cpu += clock() - c0
            row = row_from_times(name, "reference", "hash", size, len(frames), times)
            row.extra["per_core_gbps"] = _per_core_gbps(size * len(frames) * rounds, cpu)
            out.append(row)
    return out, missing


def _sealed_batch(size: int, max_batch_bytes: int) -> tuple[list[str], list[memoryview]]:
    """(keys, sealed frames) of one batch of `size`-byte payloads (up to `BATCH` of them, at
    most `max_batch_bytes`), page aligned as a tier's staging is; the payloads are written
    (a pattern), so the hashes read memory a frame really occupies."""
    n = max(1, min(BATCH, max_batch_bytes // size))
    stride = block.frame_size(size, block.PAGE)
    buf = block.alloc_aligned(n * stride)
    keys = [f"{'0' * NS_HEX}{i:032x}" for i in range(n)]
    frames = [buf[i * stride:i * stride + block.HEADER_SIZE + size] for i in range(n)]
    pattern = (bytes(range(256)) * (size // 256 + 1))[:size]
    for key, frame in zip(keys, frames):
        frame[block.HEADER_SIZE:] = pattern
        block.seal(frame, key, size)
    return keys, frames


def _per_core_gbps(nbytes: int, cpu_s: float) -> float:
    return round(nbytes / max(cpu_s, 1e-9) / 1e9, 2)


def checksum_rows(sizes, max_batch_bytes: int, rounds: int = 5) -> list[Row]:
    """One-thread and pool rows per block size (reference rows of the bench)."""
    out = []
    for size in sizes:
        keys, frames = _sealed_batch(size, max_batch_bytes)
        n = len(frames)
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
        row.extra["per_core_gbps"] = _per_core_gbps(size * n * rounds, sum(cpu))
        out.append(row)
        prow = row_from_times(f"xxh3 verify, {verify_pool.threads()} threads", "reference",
                              "verify", size, n, pool)
        prow.extra["threads"] = verify_pool.threads()
        prow.extra["scaling"] = round(row.p50_ms / prow.p50_ms, 2)
        out.append(prow)
    return out
