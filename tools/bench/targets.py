"""What `kvtier bench tiers` times: a tier through the contract, or raw Mooncake calls.

A target runs one round at a time: a timed put of one batch of sealed frames, a timed get of
the batch, and an untimed delete. `Workload` holds the frames (sealed in place, page-aligned)
and the read buffers; every target of a group reads and writes the same memory.
"""

from __future__ import annotations

import os
import time

import numpy as np

from kvtier.store.base.block import (HEADER_SIZE, alloc_aligned, frame_size, parse_header, seal,
                                     verify)
from kvtier.store.base.errors import TierError, TierFullError
from kvtier.store.base.keys import Namespace
from kvtier.tiers.base import MISS

SLOT_ALIGN = 4096


class Workload:
    """One pair of page-aligned buffers: sealed frames out of `src`, reads into `dst`."""

    def __init__(self, max_bytes: int):
        self.src = alloc_aligned(max_bytes)
        self.dst = alloc_aligned(max_bytes)
        rng = np.random.default_rng(0)
        np.frombuffer(self.src, np.uint8)[:] = rng.integers(0, 256, len(self.src), np.uint8)
        self.ns = Namespace(model="kvtier-bench").fingerprint()

    def case(self, block: int, batch: int) -> tuple[list[str], list[memoryview], list[memoryview]]:
        """Fresh keys, frames sealed in place, and out buffers. Each frame is handed over as
        its whole page-aligned slot (the frame, then padding), as a connector's aligned
        staging would: a tier stores the frame its header describes, and O_DIRECT can write
        the slot without a bounce copy."""
        slot = frame_size(block, SLOT_ALIGN)
        keys = [self.ns + os.urandom(16).hex() for _ in range(batch)]
        frames = [self.src[i * slot:(i + 1) * slot] for i in range(batch)]
        for key, frame in zip(keys, frames):
            seal(frame, key, block)
        outs = [self.dst[i * slot:(i + 1) * slot] for i in range(batch)]
        return keys, frames, outs


class TierTarget:
    """A tier under test: one timed put and get per round, then an untimed delete."""

    def __init__(self, label: str, tier, reference: str | None, **extra):
        self.label, self.tier, self.reference, self.extra = label, tier, reference, extra
        self.kind = tier.kind

    def prefault(self, work: "Workload", block: int, batch: int) -> None:
        """Fill the pool segment once, then empty it: Mooncake faults segment memory in
        lazily, and a round landing on fresh pages pays the kernel's page zeroing (a first
        512 MiB put ran at 1.0 GB/s here, later ones at 4.4-6.0)."""
        if self.kind != "mooncake" or getattr(self.tier, "_bench_prefaulted", False):
            return
        held: list[str] = []
        try:
            while len(held) * block < 0.9 * self.tier.capacity_bytes:
                keys, frames, _ = work.case(block, batch)
                if not all(self.tier.put(keys, frames)):
                    break
                held += keys
        except TierFullError:
            pass  # full before 90%: every page it could use is touched
        self.tier.delete(held)
        self.tier._bench_prefaulted = True

    def round(self, keys, frames, outs) -> tuple[float, float]:
        if "zero_copy" in self.extra:
            self.tier.zero_copy = self.extra["zero_copy"]
        t0 = time.perf_counter()
        stored = self.tier.put(keys, frames)
        t1 = time.perf_counter()
        got = self.tier.get(keys, outs)
        t2 = time.perf_counter()
        self.tier.delete(keys)
        if not all(stored) or MISS in got:
            raise RuntimeError(f"{self.label}: {stored.count(False)} puts failed and "
                               f"{got.count(MISS)} gets missed in a bench round; see its counters "
                               f"{self.tier.counters()}")
        return t1 - t0, t2 - t1


class RawTarget:
    """Raw Mooncake batch calls on the same buffers (registered once).

    With `verify`, each frame read is also checked (`block.verify`) after the call: the floor
    of any tier that obeys the contract, which shows what the tier's own code adds.
    """

    kind = "reference"
    reference = None
    extra: dict = {}

    def __init__(self, raw, work: Workload, verify: bool = False, label: str = "raw mooncake"):
        self.label = f"{label}+verify" if verify else label
        self.raw, self.verify = raw, verify
        self.src, self.dst = raw.register(work.src), raw.register(work.dst)

    def prefault(self, work: "Workload", block: int, batch: int) -> None:
        """As `TierTarget.prefault`, for the raw client's own segment."""
        if getattr(self.raw, "prefaulted", False):
            return
        slot, held = frame_size(block, SLOT_ALIGN), []
        while len(held) * block < 0.9 * self.raw.client.cfg.capacity_bytes:
            keys, frames, _ = work.case(block, batch)
            try:
                self.raw.put(keys, [self.src + i * slot for i in range(batch)],
                             [HEADER_SIZE + block] * batch)
            except TierError:
                break  # full: every page it could use is touched
            held += keys
        self.raw.remove(held)
        self.raw.prefaulted = True

    def round(self, keys, frames, outs) -> tuple[float, float]:
        slot = len(outs[0])
        sizes = [HEADER_SIZE + parse_header(f).payload_len for f in frames]  # as the tier
        src = [self.src + i * slot for i in range(len(keys))]
        dst = [self.dst + i * slot for i in range(len(keys))]
        t0 = time.perf_counter()
        self.raw.put(keys, src, sizes)
        t1 = time.perf_counter()
        self.raw.get(keys, dst, sizes)
        if self.verify:
            for key, out, size in zip(keys, outs, sizes):
                verify(out[:size], key, size)
        t2 = time.perf_counter()
        self.raw.remove(keys)
        return t1 - t0, t2 - t1
