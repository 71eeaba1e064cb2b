"""`check` and `repair` of the nvme tier (`NvmeTier.check` / `.repair`; kinds: `tiers.base`).

`check` takes the tier's READY entries, the region records and the `B` rows (what was
allocated where) in one LMDB read transaction, a consistent snapshot; then reads every frame
an entry points at back from the data file and verifies it against the entry.

Guarantees:
- read-only: no index entry, region row, file or byte changes (open the tier with
  `TierContext(recover=False)` so the open-time recovery does not change them either);
- safe beside live writers: PENDING entries are never looked at (a dead writer's are the node
  check's `pending`), and a frame that fails verification is reported only if its entry and
  its region's generation are unchanged after the read; otherwise a writer reclaimed the
  region under the read, which is a miss, not a problem;
- entries of a generation the region table marks reclaimed (`C` rows) are not problems:
  every reader already sees them as misses, and the reclaimer drops them right after (the next
  open does, after a crash);
- kinds: `missing` (the entry points at no bytes of its block: a region of another generation
  with no reclaim pending, or beyond the capacity, an offset the region never allocated, past
  the end of the data file, a hole never written), `region` (the region table records
  another block, or none, where the entry points: reclaim would never drop the entry),
  `size` / `checksum` (a sound frame of the key that the entry disagrees with), `corrupt`
  (the frame fails verification or cannot be read), `orphan` (any file in the tier directory
  but the data file), `stale_temp` (an old start-up probe file).

`repair` checks the keys it is given again and drops the entries still bad, index transaction
first: their bytes become dead space of their region and come back when it is reclaimed, as
after a corrupt read (online, an entry rewritten between that second look and the drop is
dropped too: a miss, never wrong bytes). It removes orphans and stale probes, then runs the
region table's open-time recovery (park dead writers' regions, drop entries of reclaimed
generations).
"""

from __future__ import annotations

import os
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.store.base import block
from kvtier.store.base.errors import CorruptBlockError
from kvtier.store.base.index_record import READY, Entry
from kvtier.tiers.base import Problem
from kvtier.tiers.files import check as check_files
from kvtier.tiers.files.buffers import round_up
from kvtier.tiers.files.check import (PROBE_PREFIX, Ticker, batches, describe, lstat_or_none,
                                      probe_problem, remove_path)
from kvtier.tiers.nvme.io_engines import IOOp
from kvtier.tiers.nvme.region_rows import RETIRED, Region, unpack_loc
from kvtier.tiers.nvme.regions import DATA_FILE

ENTRY_KINDS = ("missing", "region", "size", "checksum", "corrupt")


@dataclass
class Snapshot:
    entries: list[Entry] = field(default_factory=list)
    regions: dict[int, Region | None] = field(default_factory=dict)
    allocated: dict[tuple[int, int, int], str | None] = field(default_factory=dict)
    reclaimed: set[tuple[int, int]] = field(default_factory=set)  # (slot, gen) with a C row
    file_bytes: int = -1  # -1: there is no data file
    next_after: bytes | None = None  # where the next page starts (None: this was the last)


def check(tier, progress=None) -> list[Problem]:
    """Every problem of the tier; changes nothing."""
    ticker = Ticker(progress, tier.index.tier_usage(tier.name)[0])
    problems, after = [], b""
    while after is not None:  # page by page; each page is one consistent snapshot
        snap = snapshot(tier, after=after, limit=check_files.PAGE_ENTRIES)
        problems += _check_entries(tier, snap, ticker)
        after = snap.next_after
    return problems + _dir_problems(tier)


def repair(tier, problems) -> int:
    """Drop the entries still bad, remove orphans and stale probes; return how many."""
    keys = sorted({p.key for p in problems if p.key and p.kind in ENTRY_KINDS})
    fixed = 0
    if keys:
        bad = [p.key for p in _check_entries(tier, snapshot(tier, keys), Ticker(None, 0))]
        fixed += len(tier.index.delete(tier.name, bad))
    for p in problems:
        if p.kind in ("orphan", "stale_temp") and p.path and _still_junk(tier, Path(p.path)):
            fixed += remove_path(Path(p.path), tier.path)
    tier.regions.recover()
    tier.regions.drop_reclaimed()
    return fixed


def snapshot(tier, keys: list[str] | None = None, after: bytes = b"",
             limit: int = sys.maxsize) -> Snapshot:
    """READY entries (of `keys`, or up to `limit` of the tier's after the index row `after`)
    and the region rows they name, in one read transaction."""
    index, snap = tier.index, Snapshot()
    with index.read() as txn:
        if keys is None:
            snap.entries, snap.next_after = txn.ready_page(tier.name, after, limit)
        else:
            found = [txn.entry(tier.name, k) for k in keys]
            snap.entries = [e for e in found if e is not None and e.state == READY]
        snap.regions, snap.allocated, snap.reclaimed = tier.regions.rows_of(txn, snap.entries)
    snap.file_bytes = os.fstat(tier._fd).st_size if tier._fd >= 0 else -1
    return snap


def _check_entries(tier, snap: Snapshot, ticker: Ticker) -> list[Problem]:
    problems, placed = [], []
    for e in snap.entries:
        if unpack_loc(e.loc_a) in snap.reclaimed:
            # Its region was reclaimed and the reclaimer has yet to drop its entries (it does
            # right after, or the next open does after a crash): dead to every reader already.
            continue
        why = misplaced(tier, e, snap)
        if why is None:
            placed.append(e)
        else:
            problems.append(Problem(why[0], tier.name, e.key, detail=why[1]))
    ticker.add(len(snap.entries) - len(placed))
    return problems + _verify(tier, placed, ticker)


def misplaced(tier, e: Entry, snap: Snapshot) -> tuple[str, str] | None:
    """(kind, why) if the entry cannot point at its frame, judged from the snapshot alone."""
    slot, gen = unpack_loc(e.loc_a)
    r, end = snap.regions.get(slot), e.loc_b + round_up(e.size)
    if slot >= tier.n_regions:
        return "missing", f"region {slot} is beyond the tier's {tier.n_regions} regions"
    if r is None or r.state == RETIRED or r.gen != gen:
        now = "never used" if r is None else f"at generation {r.gen}"
        return "missing", f"region {slot} is {now}; the entry names generation {gen}"
    if e.loc_b % block.PAGE or e.loc_b >= min(r.off, tier.region_bytes):
        return "missing", f"region {slot} never allocated offset {e.loc_b} (written up to {r.off})"
    if e.size < block.HEADER_SIZE or end > tier.region_bytes:
        return "size", f"the entry's {e.size} bytes at offset {e.loc_b} do not fit region {slot}"
    if snap.file_bytes < 0:
        return "missing", f"the data file {tier.path / DATA_FILE} does not exist"
    if slot * tier.region_bytes + end > snap.file_bytes:
        return "missing", f"region {slot} offset {e.loc_b} is past the end of the data file " \
                          f"({snap.file_bytes} bytes)"
    owner = snap.allocated.get((slot, gen, e.loc_b))
    if owner != e.key:
        what = f"block {owner}" if owner else "no block"
        return "region", f"the region table records {what} at region {slot} offset {e.loc_b}"
    return None


def _verify(tier, entries: list[Entry], ticker: Ticker) -> list[Problem]:
    """Read each entry's frame back and compare; problems only where nothing moved since."""
    problems = []
    for batch in batches(entries, lambda e: round_up(e.size)):
        bufs = [tier._bounce.take(round_up(e.size)) for e in batch]
        try:
            ops = [IOOp(tier._fd, b[:round_up(e.size)], tier.regions.offset(e), False)
                   for b, e in zip(bufs, batch)]
            for e, buf, res in zip(batch, bufs, tier._engine.run(ops)):
                p = frame_problem(tier, e, buf, res)
                if p is not None and _unchanged(tier, e):
                    problems.append(p)
        finally:
            for b in bufs:
                tier._bounce.give(b)
        ticker.add(len(batch))
    return problems


def frame_problem(tier, e: Entry, buf: memoryview, res: int) -> Problem | None:
    """What is wrong with the frame read for `e` (`res` bytes or -errno), if anything."""
    slot = unpack_loc(e.loc_a)[0]
    where = f"region {slot} offset {e.loc_b}"
    if res < 0:
        return Problem("corrupt", tier.name, e.key, detail=f"read at {where} failed "
                                                          f"({os.strerror(-res)})")
    view = buf[:res]
    if not any(bytes(view[:block.HEADER_SIZE])):
        return Problem("missing", tier.name, e.key,
                       detail=f"no frame at {where} (never written, or lost in a power failure)")
    try:
        h = block.parse_header(view)
        if h.key == e.key and h.frame_len != e.size:
            return Problem("size", tier.name, e.key,
                           detail=f"the entry says {e.size} bytes, the frame {h.frame_len}")
        block.verify(view, e.key, length=res)
    except CorruptBlockError as err:
        return Problem("corrupt", tier.name, e.key, detail=f"frame at {where}: {err}")
    if h.checksum != e.checksum:
        return Problem("checksum", tier.name, e.key, detail=f"the entry says "
                       f"{e.checksum:016x}, the frame {h.checksum:016x}")
    return None


def _unchanged(tier, e: Entry) -> bool:
    """The entry and its region's generation are as they were before the read."""
    now = tier.index.get(tier.name, [e.key])[0]
    slot, gen = unpack_loc(e.loc_a)
    return (now is not None and _same(now, e)
            and tier.regions.generations({slot})[slot] == gen)


def _same(a: Entry, b: Entry) -> bool:
    return (a.loc_a, a.loc_b, a.size, a.checksum, a.created) == \
        (b.loc_a, b.loc_b, b.size, b.checksum, b.created)


def _dir_problems(tier) -> list[Problem]:
    """Anything in the tier directory but the data file (and probes in flight)."""
    out, now = [], time.time()
    with os.scandir(tier.path) as it:
        found = [(Path(d.path), d.name) for d in it]
    for path, name in found:
        p = _path_problem(tier, path, name, now)
        if p is not None:
            out.append(p)
    return out


def _path_problem(tier, path: Path, name: str, now: float) -> Problem | None:
    st = lstat_or_none(path)
    if st is None:
        return None
    if name == DATA_FILE and stat.S_ISREG(st.st_mode):
        return None
    if name == "lost+found" and stat.S_ISDIR(st.st_mode):
        return None  # the tier directory is a mount's root: the filesystem's own
    if name.startswith(PROBE_PREFIX) and stat.S_ISREG(st.st_mode):
        return probe_problem(tier.name, path, st, now)
    return Problem("orphan", tier.name, path=str(path), detail=describe(st))


def _still_junk(tier, path: Path) -> bool:
    return path.parent == tier.path and \
        _path_problem(tier, path, path.name, time.time()) is not None
