"""The nvme tier: a node-local, log-structured block store on one data file, O_DIRECT.

Layout (CacheLib BlockCache is the model): `<path>/regions.kvr` holds `capacity // region_size`
regions. Each writer process appends sealed frames to its own open region at 4 KiB-aligned
offsets; a full region is sealed; when no fresh region is left the oldest sealed one is
reclaimed whole (FIFO) and its blocks drop out of the index. `tiers.nvme.regions` keeps that
bookkeeping in the node's LMDB index; locations and checksums live in the index entries.

Guarantees, on top of the contract of `tiers.base`:
- A put is reserve (PENDING) -> generation re-check -> O_DIRECT write -> commit, so the index
  never points at bytes that are not fully written, in any process of the node.
- A get reads only READY entries of a live region generation and verifies every frame; a
  frame that fails while its region is unchanged is corrupt: counted, dropped from the index
  (its bytes become dead space of the region) and returned as MISS. A frame that fails because
  its region was reclaimed under the read is a plain miss.
- A full tier reclaims regions by itself; TierFullError only for ENOSPC (the disk under the
  file is full) or when every region is held by a live writer. `.stored` lists the batch's
  keys that are stored. After ENOSPC the tier takes no fresh region until it is opened again:
  the next puts reclaim the oldest sealed regions, whose disk blocks exist.
- Blocks survive a restart of the process (the index and the file persist). A power loss may
  lose recent writes (no fsync of the data file): those frames fail verification, so they are
  misses, never wrong bytes.
- PENDING entries of dead writers are dropped at open (`Index.recover`); their bytes are dead
  space of a region and come back when the region is reclaimed. Open regions of dead writers
  are adopted by the next writer.
- `put` returns True also for a key another live writer of this node holds PENDING: the bytes
  are the same by the key's definition, and a later miss is no different from an eviction.

Engines (`io.engine`): `uring` (io_uring, `io.queue_depth` in flight) or `psync` (reference).
Zero copy: a frame (put) or out buffer (get) that starts on a 4 KiB boundary and whose view
reaches the next 4 KiB boundary after the frame (as `block.alloc_aligned` buffers do) goes to
the disk as is; any other goes through a bounce buffer (one memcpy).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Sequence

from kvtier.store.base import block
from kvtier.store.base.config import NvmeTierConfig
from kvtier.store.base.errors import ConfigError, CorruptBlockError, TierError, TierUnavailableError
from kvtier.store.base.index_record import PENDING, READY, Entry, owner_alive
from kvtier.tiers.base import TierContext
from kvtier.tiers.base import MISS, Tier, full_error
from kvtier.tiers.files.buffers import BouncePool, checked_header, round_up
from kvtier.tiers.files.paths import prepare_tier_dir
from kvtier.tiers.nvme import check as nvme_check
from kvtier.tiers.nvme.io_engines import IOOp, make_engine
from kvtier.tiers.nvme.regions import (DATA_FILE, NoRegionError, RegionTable, pack_loc,
                                       unpack_loc)

log = logging.getLogger(__name__)


class NvmeTier(Tier):
    kind = "nvme"

    def __init__(self, cfg: NvmeTierConfig, ctx: TierContext):
        super().__init__(cfg.name, cfg.capacity_bytes)
        self.cfg, self.index = cfg, ctx.index
        self.path = prepare_tier_dir(Path(cfg.path), cfg.name, self.kind)
        self.region_bytes = cfg.region_bytes
        self.n_regions = cfg.capacity_bytes // cfg.region_bytes
        self._bounce = BouncePool()
        self._closed = True
        self.regions = RegionTable(ctx.index, cfg.name, self.n_regions, self.region_bytes)
        recorded = self.regions.check_layout()
        if recorded is not None:
            raise ConfigError(f"nvme tier {cfg.name!r} at {self.path} was formatted with "
                              f"region_size {recorded} bytes, the policy says "
                              f"{self.region_bytes}; restore region_size or use a new path "
                              "and index")
        self._fd = self._open_data(create=ctx.recover)
        try:
            self._engine = make_engine(cfg.io.engine, cfg.io.queue_depth)
        except BaseException:
            if self._fd >= 0:
                os.close(self._fd)
            raise
        self._closed = False
        if ctx.recover:  # a check opens without it: it must see the leftovers (nvme_check)
            self.index.recover()
            self.regions.recover()
            self.regions.drop_reclaimed()

    def _open_data(self, create: bool = True) -> int:
        """The data file, made and sized if need be; with `create` False (a check) opened
        read-only as it is, -1 if it does not exist."""
        path = self.path / DATA_FILE
        flags = os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY)
        if self.cfg.io.direct:
            flags |= os.O_DIRECT
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            if e.errno == errno.ENOENT and not create:
                return -1
            if e.errno == errno.EINVAL and self.cfg.io.direct:
                raise ConfigError(f"nvme tier {self.name!r}: the filesystem under {self.path} "
                                  "does not support O_DIRECT; use a local disk or set "
                                  "io.direct: false") from None
            raise TierUnavailableError(f"nvme tier {self.name!r}: cannot open {path} "
                                       f"({e.strerror}); check the path and its permissions"
                                       ) from None
        size = self.n_regions * self.region_bytes
        if not create:
            return fd
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # sparse: disk blocks are taken as regions fill
        except OSError as e:
            os.close(fd)
            raise TierUnavailableError(f"nvme tier {self.name!r}: cannot size {path} to "
                                       f"{size} bytes ({e.strerror}); lower its capacity"
                                       ) from None
        return fd

    # ---- the contract ------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        entries = self.index.get(self.name, keys)
        gens = self._gens(entries)
        return [self._live(e, gens) for e in entries]

    def put(self, keys: Sequence[str], frames: Sequence[memoryview]) -> list[bool]:
        self._check_open()
        headers = [checked_header(k, f) for k, f in zip(keys, frames)]
        for h in headers:
            if round_up(h.frame_len) > self.region_bytes:
                raise ValueError(f"a {h.frame_len}-byte frame does not fit a region of "
                                 f"{self.region_bytes} bytes; raise region_size of tier "
                                 f"{self.name!r}")
        results = [False] * len(keys)
        todo, dups = self._to_write(keys, results)
        reclaimed: list[tuple[int, int]] = []
        full = None
        if todo:
            try:
                full = self._write_new(keys, frames, headers, todo, results, reclaimed)
            finally:
                self.regions.drop_reclaimed(reclaimed)
        for dup, first in dups.items():
            results[dup] = results[first]
        if full is not None:
            raise full_error(self.name, full, "free space on the disk or lower its capacity",
                             [k for k, ok in zip(keys, results) if ok])
        return results

    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int]:
        self._check_open()
        entries = self.index.get(self.name, keys)
        gens = self._gens(entries)
        results = [MISS] * len(keys)
        live = [i for i, e in enumerate(entries) if self._live(e, gens)]
        for i in live:
            if len(outs[i]) < entries[i].size:
                raise ValueError(f"out buffer of {len(outs[i])} bytes is too small for block "
                                 f"{keys[i]} ({entries[i].size} bytes); size buffers by the "
                                 "namespace's frame")
        bufs = {i: self._bounce.for_read(outs[i], round_up(entries[i].size)) for i in live}
        try:
            ops = [IOOp(self._fd, bufs[i][0], self.regions.offset(entries[i]), False) for i in live]
            for i, res in zip(live, self._engine.run(ops)):
                results[i] = self._finish_read(entries[i], bufs[i], outs[i], res)
        finally:
            self._bounce.give_back(bufs.values())
        self.stats.add_reads(results)
        return results

    def delete(self, keys: Sequence[str]) -> int:
        self._check_open()
        gone = [e for e in self.index.delete(self.name, keys) if e.state == READY]
        self.stats.add(deletes=len(gone))
        return len(gone)

    def used_bytes(self) -> int:
        return self.index.tier_usage(self.name)[1]

    def check(self, progress=None):
        return nvme_check.check(self, progress)

    def repair(self, problems) -> int:
        return nvme_check.repair(self, problems)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.regions.park_mine()
        self._engine.close()
        if self._fd >= 0:
            os.close(self._fd)
        self._bounce.clear()

    # ---- writes ------------------------------------------------------------------------

    def _to_write(self, keys: Sequence[str], results: list[bool]):
        """(indexes to write, {duplicate index: first index}); marks stored keys True."""
        entries = self.index.get(self.name, keys, ready_only=False)
        gens = self._gens(entries)
        todo, first, dups, stale = [], {}, {}, []
        for i, (key, e) in enumerate(zip(keys, entries)):
            if key in first:
                dups[i] = first[key]
            elif self._live(e, gens) or _live_pending(e, gens):
                results[i] = True
            else:
                if e is not None:
                    stale.append(key)  # a reclaimed generation or a dead writer's reservation
                first[key] = i
                todo.append(i)
        if stale:
            self.index.delete(self.name, stale)
        return todo, dups

    def _write_new(self, keys, frames, headers, todo, results, reclaimed) -> str | None:
        """Allocate, reserve, write and commit `todo`; return why the tier is full, if it is."""
        sizes = [round_up(headers[i].frame_len) for i in todo]
        try:
            alloc = self.regions.allocate(sizes, [keys[i] for i in todo])
        except NoRegionError:
            return f"all {self.n_regions} regions are held by live writers"
        reclaimed.extend(alloc.reclaimed)
        entries = [Entry(keys[i], self.name, size=headers[i].frame_len,
                         checksum=headers[i].checksum, loc_a=pack_loc(s, g), loc_b=off)
                   for i, (s, g, off) in zip(todo, alloc.locs)]
        reserved = self.index.reserve(entries)
        gens = self.regions.generations({s for s, _, _ in alloc.locs})
        go, lost = [], []
        for j, (i, ok) in enumerate(zip(todo, reserved)):
            if not ok:
                results[i] = True  # another writer stored or is storing the same key
            elif gens[alloc.locs[j][0]] != alloc.locs[j][1]:
                lost.append(keys[i])  # reclaimed before we wrote a byte: not written
            else:
                go.append(j)
        if lost:
            self.index.abort(self.name, lost)
        return self._write_reserved([todo[j] for j in go], [entries[j] for j in go],
                                    [sizes[j] for j in go], keys, frames, results)

    def _write_reserved(self, idx, entries, sizes, keys, frames, results) -> str | None:
        if not idx:
            return None
        bufs = [self._bounce.for_write(frames[i], e.size, n)
                for i, e, n in zip(idx, entries, sizes)]
        try:
            ops = [IOOp(self._fd, b, self.regions.offset(e), True)
                   for (b, _), e in zip(bufs, entries)]
            res = self._engine.run(ops)
        finally:
            self._bounce.give_back(bufs)
        done = [k for k, r, n in zip(idx, res, sizes) if r == n]
        failed = [keys[k] for k, r, n in zip(idx, res, sizes) if r != n]
        enospc = any(r == -errno.ENOSPC or 0 <= r < n for r, n in zip(res, sizes))
        if failed:
            self.index.abort(self.name, failed)
        self.index.commit(self.name, [keys[i] for i in done])
        for i in done:
            results[i] = True
        errors = sum(1 for r in res if r < 0 and r != -errno.ENOSPC)
        self.stats.add(puts=len(done), errors=errors,
                       bytes_in=sum(e.size for e, r, n in zip(entries, res, sizes) if r == n))
        if errors:
            log.warning("nvme tier %r: %d writes failed (%s)", self.name, errors,
                        os.strerror(-min(res)))
        if not enospc:
            return None
        self.regions.out_of_space()  # from now on reclaim old regions instead of new ones
        return f"the disk under {self.path} is full (ENOSPC)"

    # ---- reads -------------------------------------------------------------------------

    def _finish_read(self, e: Entry, buf_info, out: memoryview, res: int) -> int:
        buf, bounce = buf_info
        if res < 0:
            self.stats.add(errors=1)
            log.warning("nvme tier %r: read of %s failed (%s)", self.name, e.key,
                        os.strerror(-res))
            return MISS
        try:
            h = block.verify(buf, e.key, length=res)
            if h.frame_len != e.size or h.checksum != e.checksum:
                raise CorruptBlockError("header does not match the index entry")
        except CorruptBlockError as err:
            self._corrupt(e, str(err))
            return MISS
        if bounce is not None:
            memoryview(out)[:e.size] = buf[:e.size]
        return h.payload_len

    def _corrupt(self, e: Entry, why: str) -> None:
        slot, gen = unpack_loc(e.loc_a)
        if self.regions.generations({slot})[slot] != gen:
            return  # the region was reclaimed while we read: a miss, not corruption
        now = self.index.get(self.name, [e.key], ready_only=False)[0]
        if now is not None and (now.loc_a, now.loc_b) == (e.loc_a, e.loc_b):
            self.index.delete(self.name, [e.key])
        self.stats.add(corrupt=1)
        log.warning("nvme tier %r: block %s at region %d offset %d is corrupt (%s); dropped",
                    self.name, e.key, slot, e.loc_b, why)

    # ---- helpers -----------------------------------------------------------------------

    def _gens(self, entries: Sequence[Entry | None]) -> dict[int, int]:
        return self.regions.generations({unpack_loc(e.loc_a)[0] for e in entries if e})

    @staticmethod
    def _live(e: Entry | None, gens: dict[int, int]) -> bool:
        if e is None or e.state != READY:
            return False
        slot, gen = unpack_loc(e.loc_a)
        return gens.get(slot) == gen

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"nvme tier {self.name!r} is closed; open it again")


def _live_pending(e: Entry | None, gens: dict[int, int]) -> bool:
    if e is None or e.state != PENDING:
        return False
    slot, gen = unpack_loc(e.loc_a)
    return gens.get(slot) == gen and owner_alive(e.owner_pid, e.created)
