"""Region bookkeeping of the nvme tier, kept in the node's LMDB index (CacheLib BlockCache style).

The tier's data file is `n_regions` regions of `region_bytes`. A writer process owns one OPEN
region and appends frames to it at 4 KiB-aligned offsets; a full region is SEALED and queued in
seal order; when no fresh region is left, the oldest sealed region is reclaimed whole (FIFO).
All of it happens inside LMDB write transactions, so two processes never get the same bytes.

One LMDB table per tier (`nvme.<tier>`), rows by prefix:
- `S` slot -> region record (state, owner pid and open time, generation, write offset, seq)
- `Q` seq -> slot: the sealed FIFO, oldest first
- `B` slot gen offset -> block key: what was allocated where (to find a region's blocks)
- `C` slot gen -> b"": a reclaimed generation whose index entries still need dropping
- `P` slot -> b"": an open region without a live writer, to be adopted first
- `M` name -> value: the fresh-slot counter, the seal counter, the layout, and `nospace`
  while the disk under the data file is full (set on ENOSPC, cleared at open)

Locations in the index: `loc_a = gen << 32 | slot`, `loc_b = offset in the region`. Reclaim
bumps the region's generation in the same transaction that hands it to its new writer, so an
index entry of the old generation is dead at once; readers check the generation and the
frame header, and the `C` rows let the tier drop those entries even after a crash.

A region is reclaimed only when none of its blocks is PENDING for a live writer: the writer
reserves its entries, then re-checks the generation before writing a byte, so a reclaimer
either sees the reservation and skips the region, or bumps the generation first and the writer
aborts. Open regions of dead writers are parked (at open, and by every writer once a minute)
and adopted by the next writer that needs room.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from kvtier.store.base.index import Index
from kvtier.store.base.index_record import PENDING, Entry, owner_alive
from kvtier.store.base.keys import key_bytes
from kvtier.tiers.nvme.region_rows import (BLK, OPEN, RETIRED, SEALED, SEQ, SLOT, Allocation,
                                      Region, orphaned, pack_loc, unpack_loc)

__all__ = ["DATA_FILE", "Allocation", "NoRegionError", "RegionTable", "pack_loc", "unpack_loc"]
DATA_FILE = "regions.kvr"  # the tier's one data file, in its directory
ORPHAN_SCAN_S = 60.0  # how often a long-running writer looks for regions of dead writers

class NoRegionError(Exception):
    """Every region is open by a live writer or has writes in flight."""


class RegionTable:
    """The region rows of one nvme tier; every method runs in its own LMDB transaction."""

    def __init__(self, index: Index, tier: str, n_regions: int, region_bytes: int):
        self.index, self.tier = index, tier
        self.n_regions, self.region_bytes = n_regions, region_bytes
        self._tid = index.tier_id(tier)
        self._t = f"nvme.{tier}"
        index.open_table(self._t)  # outside any transaction: it takes LMDB's write lock
        self._orphan_scan_at = time.monotonic()  # recover() at open has just done one
        self._mine: tuple[int, float] | None = None  # (slot, opened_at) of this process's region
        self._pid = os.getpid()

    # ---- open and close --------------------------------------------------------------

    def offset(self, e: Entry) -> int:
        """Where the frame of index entry `e` starts in the data file."""
        return unpack_loc(e.loc_a)[0] * self.region_bytes + e.loc_b

    def check_layout(self) -> str | None:
        """Record the region size on first use; return the recorded one if it differs."""

        def go(txn):
            have = txn.get(self._t, b"Mlayout")
            if have is None:
                txn.put(self._t, b"Mlayout", str(self.region_bytes).encode())
                return None
            return None if int(have) == self.region_bytes else have.decode()
        return self.index.run_write(go)

    def recover(self) -> None:
        """Park open regions of dead writers; retire slots beyond `n_regions` (capacity shrank)
        and bring back retired slots within it (capacity grew again)."""

        def go(txn):
            txn.delete(self._t, b"Mnospace")  # a new chance for fresh regions (see below)
            for r in self._regions(txn):
                if r.slot >= self.n_regions and r.state != RETIRED:
                    self._retire(txn, r)
                elif r.slot < self.n_regions and r.state == RETIRED:
                    r.state = OPEN
                    self._park(txn, r)
                elif orphaned(r):
                    self._park(txn, r)
        self.index.run_write(go)

    def _regions(self, txn) -> list[Region]:
        """Every region row (a scan: at open, or when nothing else is left)."""
        return [Region.decode(SLOT.unpack(k[1:])[0], raw)
                for k, raw in txn.rows(self._t, prefix=b"S")]

    def park_mine(self) -> None:
        """Let another writer adopt this process's open region (at close)."""
        if self._mine is None or os.getpid() != self._pid:
            return

        def go(txn):
            r = self._my_region(txn)
            if r is not None:
                self._park(txn, r)
        self.index.run_write(go)
        self._mine = None

    # ---- allocation --------------------------------------------------------------------

    def allocate(self, sizes: list[int], keys: list[str]) -> Allocation:
        """Reserve `sizes[i]` bytes (multiples of 4 KiB, each <= region_bytes) for `keys[i]`."""
        if os.getpid() != self._pid:
            self._pid, self._mine = os.getpid(), None

        def go(txn) -> Allocation:
            out = Allocation()
            r = self._my_region(txn)
            for size, key in zip(sizes, keys):
                while r is None or r.off + size > self.region_bytes:
                    if r is not None:
                        self._seal(txn, r)  # an adopted region may be too full as well
                    r = self._take(txn, out)
                out.locs.append((r.slot, r.gen, r.off))
                txn.put(self._t, b"B" + BLK.pack(r.slot, r.gen, r.off), key_bytes(key))
                r.off += size
            if r is not None:
                self._put(txn, r)
            return out

        return self.index.run_write(go)

    def _my_region(self, txn) -> Region | None:
        if self._mine is None:
            return None
        r = self._get(txn, self._mine[0])
        if r.state == OPEN and r.pid == os.getpid() and r.opened_at == self._mine[1]:
            return r
        self._mine = None
        return None

    def _take(self, txn, out: Allocation) -> Region:
        """A region for this process: a parked one, a fresh one, or the oldest reclaimable."""
        if time.monotonic() - self._orphan_scan_at > ORPHAN_SCAN_S:
            # Writers that died since the last scan hold open regions nobody would reclaim.
            self._orphan_scan_at = time.monotonic()
            self._park_dead(txn)
        for attempt in range(2):
            r = self._adopt(txn) or self._fresh(txn) or self._reclaim(txn, out)
            if r is not None:
                break
            self._park_dead(txn)
        else:
            raise NoRegionError()
        r.state, r.pid, r.opened_at = OPEN, os.getpid(), time.time()
        self._mine = (r.slot, r.opened_at)
        return r

    def _adopt(self, txn) -> Region | None:
        for k, _ in list(txn.rows(self._t, prefix=b"P")):
            txn.delete(self._t, k)
            r = self._get(txn, SLOT.unpack(k[1:])[0])
            if r.state == OPEN and r.pid == 0 and r.off < self.region_bytes:
                return r
        return None

    def out_of_space(self) -> None:
        """The disk under the data file is full (ENOSPC): take no fresh region until the next
        open, so writers reclaim the oldest sealed regions (whose disk blocks exist) instead,
        and seal this process's open region, whose tail the disk could not hold."""

        def go(txn):
            txn.put(self._t, b"Mnospace", b"1")
            r = self._my_region(txn)
            if r is not None:
                self._seal(txn, r)
        self.index.run_write(go)

    def _fresh(self, txn) -> Region | None:
        if txn.get(self._t, b"Mnospace") is not None:
            return None  # the disk is full: a fresh (sparse) region would fail again
        raw = txn.get(self._t, b"Mfresh")
        slot = int(raw) if raw else 0
        if slot >= self.n_regions:
            return None
        txn.put(self._t, b"Mfresh", str(slot + 1).encode())
        return Region(slot)

    def _reclaim(self, txn, out: Allocation) -> Region | None:
        # Lazily, oldest first: the rows change only right before the return.
        for k, raw in txn.rows(self._t, prefix=b"Q"):
            r = self._get(txn, SLOT.unpack(raw)[0])
            if self._has_live_writes(txn, r):
                continue  # a writer is still filling it: try the next oldest
            txn.delete(self._t, k)
            out.reclaimed.append((r.slot, r.gen))
            txn.put(self._t, b"C" + SLOT.pack(r.slot) + SLOT.pack(r.gen), b"")
            r.gen, r.off, r.seq = r.gen + 1, 0, 0
            return r
        return None

    def _has_live_writes(self, txn, r: Region) -> bool:
        loc_a = pack_loc(r.slot, r.gen)
        for off, kb in self._blocks(txn, r.slot, r.gen):
            e = txn.entry(self.tier, kb.hex())
            if e is None:
                continue
            if (e.state == PENDING and e.loc_a == loc_a and e.loc_b == off
                    and owner_alive(e.owner_pid, e.created)):
                return True
        return False

    def _park_dead(self, txn) -> None:
        for r in self._regions(txn):
            if orphaned(r):
                self._park(txn, r)

    def _park(self, txn, r: Region) -> None:
        r.pid = 0
        self._put(txn, r)
        txn.put(self._t, b"P" + SLOT.pack(r.slot), b"")

    def _seal(self, txn, r: Region) -> None:
        raw = txn.get(self._t, b"Mseq")
        r.seq = int(raw) + 1 if raw else 1
        txn.put(self._t, b"Mseq", str(r.seq).encode())
        r.state, r.pid = SEALED, 0
        txn.put(self._t, b"Q" + SEQ.pack(r.seq), SLOT.pack(r.slot))
        self._put(txn, r)
        self._mine = None

    def _retire(self, txn, r: Region) -> None:
        if r.state == SEALED:
            txn.delete(self._t, b"Q" + SEQ.pack(r.seq))
        txn.put(self._t, b"C" + SLOT.pack(r.slot) + SLOT.pack(r.gen), b"")
        r.state, r.pid, r.gen, r.off = RETIRED, 0, r.gen + 1, 0
        self._put(txn, r)

    # ---- reads and cleanup -------------------------------------------------------------

    def generations(self, slots: set[int]) -> dict[int, int]:
        """The current generation of each slot (0 for a slot never used or retired)."""
        out = {}
        with self.index.read() as txn:
            for slot in slots:
                raw = txn.get(self._t, b"S" + SLOT.pack(slot))
                r = Region.decode(slot, raw) if raw else None
                out[slot] = r.gen if r is not None and r.state != RETIRED else 0
        return out

    def rows_of(self, txn, entries: Sequence[Entry]):
        """The region rows `entries` name, read in the caller's transaction (`Index.read`):
        ({slot: Region or None}, {(slot, gen, offset): key hex allocated there or None},
        {(slot, gen) marked reclaimed})."""
        regions: dict[int, Region | None] = {}
        allocated: dict[tuple[int, int, int], str | None] = {}
        reclaimed: set[tuple[int, int]] = set()
        for e in entries:
            slot, gen = unpack_loc(e.loc_a)
            if slot not in regions:
                raw = txn.get(self._t, b"S" + SLOT.pack(slot))
                regions[slot] = Region.decode(slot, raw) if raw else None
            raw = txn.get(self._t, b"B" + BLK.pack(slot, gen, e.loc_b))
            allocated[(slot, gen, e.loc_b)] = raw.hex() if raw else None
            if txn.get(self._t, b"C" + SLOT.pack(slot) + SLOT.pack(gen)) is not None:
                reclaimed.add((slot, gen))
        return regions, allocated, reclaimed

    def drop_reclaimed(self, only: Sequence[tuple[int, int]] | None = None) -> None:
        """Drop the index entries of reclaimed generations (`only` those, or every one still
        marked), then their `B` rows and `C` marker. Idempotent: several processes may race."""
        if only is not None and not only:
            return
        with self.index.read() as txn:
            todo = [(SLOT.unpack(k[1:5])[0], SLOT.unpack(k[5:9])[0])
                    for k, _ in txn.rows(self._t, prefix=b"C")]
            todo = [(s, g, self._blocks(txn, s, g)) for s, g in todo
                    if only is None or (s, g) in only]
        for slot, gen, blocks in todo:
            # One key may own several offsets of a generation (a writer whose reservation
            # lost to another's keeps its allocation): match the entry against all of them.
            where: dict[str, set[int]] = {}
            for off, kb in blocks:
                where.setdefault(kb.hex(), set()).add(off)
            old = [e.key for e in self.index.get(self.tier, list(where), ready_only=False)
                   if e is not None and e.loc_a == pack_loc(slot, gen) and e.loc_b in where[e.key]]
            if old:
                self.index.delete(self.tier, old)

            def go(txn, slot=slot, gen=gen, blocks=blocks):
                for off, _ in blocks:
                    txn.delete(self._t, b"B" + BLK.pack(slot, gen, off))
                txn.delete(self._t, b"C" + SLOT.pack(slot) + SLOT.pack(gen))
            self.index.run_write(go)

    def _blocks(self, txn, slot: int, gen: int) -> list[tuple[int, bytes]]:
        prefix = b"B" + BLK.pack(slot, gen, 0)[:8]
        return [(BLK.unpack(k[1:])[2], kb) for k, kb in txn.rows(self._t, prefix=prefix)]

    def _get(self, txn, slot: int) -> Region:
        raw = txn.get(self._t, b"S" + SLOT.pack(slot))
        return Region.decode(slot, raw) if raw else Region(slot)

    def _put(self, txn, r: Region) -> None:
        txn.put(self._t, b"S" + SLOT.pack(r.slot), r.encode())
