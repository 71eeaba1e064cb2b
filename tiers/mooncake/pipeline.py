"""A two-stage pipeline for batched transfers: one chunk moves while the previous is checked.

A batch is cut into chunks (`plan_chunks`). `run_pipeline` submits the transfer of chunk k+1
to a worker thread, then runs the CPU work of chunk k (checksums, staging copies) in the
caller's thread: Mooncake releases the GIL while it transfers, so on two cores a get with
verification costs max(transfer, checksum) rather than their sum.

Chunks whose buffers are not registered go through one staging buffer. Their offsets are
assigned at run time so that a chunk never overlaps the one still in flight or being
checked (the only other chunk that may touch staging at that moment). Callers hold the
staging buffer exclusively for the whole run.

Contract: `run_pipeline` returns only after every transfer it started has finished, even
when `pre` or `post` raises, so no transfer writes into a buffer its caller has released.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

# Measured on this 2-core machine (2 MiB and 16 MiB frames, batches of 16-64): chunks under
# 8 MiB lose more to per-call overhead and to Mooncake's smaller internal batches than they
# win by overlap; 16-32 MiB chunks do best; batches up to 32 MiB run best as one call.
MIN_CHUNK_BYTES = 16 << 20
MAX_CHUNK_BYTES = 32 << 20
TARGET_CHUNKS = 4   # enough to overlap, few enough that per-call RPC overhead stays small


# Through a pool service a call is a local RPC plus one memcpy, so much smaller chunks pay
# off: measured for 512 x 32 KiB gets with verification, see `tiers.mooncake.service`.
SERVICE_MIN_CHUNK_BYTES = 4 << 20


def worth_pipelining(total_bytes: int, min_chunk: int = MIN_CHUNK_BYTES) -> bool:
    """False: move the batch in one call (nothing worth overlapping)."""
    return total_bytes > 2 * min_chunk
ALIGN = 4096        # staged frames start on page boundaries (fast copies, RDMA friendly)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Chunk:
    """Indices into the batch; `offsets` into staging once placed (None: direct buffers)."""

    idx: list[int]
    sizes: list[int]
    staged: bool
    offsets: list[int] | None = None
    span: tuple[int, int] = field(default=(0, 0))

    @property
    def staging_bytes(self) -> int:
        return sum(_align(n) for n in self.sizes)

    def place(self, start: int) -> None:
        self.offsets, pos = [], start
        for n in self.sizes:
            self.offsets.append(pos)
            pos += _align(n)
        self.span = (start, pos)


def plan_chunks(sizes: Sequence[int], direct: Sequence[bool], staging_len: int,
                merge_direct: bool = False, min_chunk: int = MIN_CHUNK_BYTES) -> list[Chunk]:
    """Cut a batch into chunks; direct chunks first. `merge_direct`: one direct chunk."""
    total = sum(sizes)
    budget = min(MAX_CHUNK_BYTES, max(min_chunk, total // TARGET_CHUNKS))
    staged_budget = min(budget, staging_len // 2)
    chunks: list[Chunk] = []
    for want_direct in (True, False):
        limit = float("inf") if (want_direct and merge_direct) else (
            budget if want_direct else staged_budget)
        cur = Chunk([], [], staged=not want_direct)
        used = 0
        for i, (n, d) in enumerate(zip(sizes, direct)):
            if d != want_direct:
                continue
            if not d and _align(n) > staging_len:
                raise ValueError(f"a {n}-byte frame does not fit the {staging_len}-byte staging "
                                 "buffer; raise the tier's staging size or register the buffer")
            if cur.idx and used + n > limit:
                chunks.append(cur)
                cur, used = Chunk([], [], staged=not want_direct), 0
            cur.idx.append(i)
            cur.sizes.append(n)
            used += n
        if cur.idx:
            chunks.append(cur)
    return chunks


def _fits_beside(chunk: Chunk, busy: Chunk | None, staging_len: int) -> int | None:
    """Where `chunk` can go without touching `busy`'s staging span, or None."""
    need = chunk.staging_bytes
    if busy is None or not busy.staged:
        return 0
    start, end = busy.span
    if end + need <= staging_len:
        return end
    if need <= start:
        return 0
    return None


def run_pipeline(worker: ThreadPoolExecutor, chunks: list[Chunk],
                 xfer: Callable[[Chunk], list[int]], pre: Callable[[Chunk], None],
                 post: Callable[[Chunk, list[int]], None], staging_len: int) -> None:
    """Run `pre`, `xfer` (on `worker`) and `post` over chunks, overlapping xfer with post."""
    if len(chunks) == 1:  # nothing to overlap: stay on this thread (lower latency)
        chunk = chunks[0]
        if chunk.staged:
            chunk.place(0)
        pre(chunk)
        post(chunk, xfer(chunk))
        return
    started: list[Future] = []
    pending: tuple[Chunk, Future] | None = None
    try:
        for chunk in chunks:
            if chunk.staged:
                start = _fits_beside(chunk, pending[0] if pending else None, staging_len)
                if start is None:  # no room beside the chunk in flight: finish it first
                    prev, fut = pending
                    pending = None
                    post(prev, fut.result())
                    start = 0
                chunk.place(start)
            pre(chunk)
            fut = worker.submit(xfer, chunk)
            started.append(fut)
            if pending is not None:
                prev, prev_fut = pending
                pending = None
                post(prev, prev_fut.result())
            pending = (chunk, fut)
        prev, fut = pending
        pending = None
        post(prev, fut.result())
    finally:
        wait(started)  # never leave a transfer running into buffers the caller may free
