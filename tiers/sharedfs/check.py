"""`check` and `repair` of the sharedfs tier (`SharedFSTier.check` / `.repair`), and the
sweep of its quarantine (`inspect gc`).

`check` walks the tree one fan-out directory at a time (`tiers.sharedfs.walk`), reads every
block file of every node back, verifies it and compares it with this node's entry of it, if
any; then looks up the file of each of this node's READY entries, a page of entries at a time
(memory stays bounded however large the tree and the index are).

Guarantees:
- read-only: no file, directory or index entry changes (open the tier with
  `TierContext(recover=False)`, so the open-time recovery and temp sweep do not run either);
- a file another node wrote that verifies is a block, not an orphan; a file that fails
  verification is `corrupt` whoever wrote it (nobody may trust it);
- safe beside live writers and other nodes: a file replaced or removed while it was read, an
  entry that changed meanwhile, or a temp file still being written is not a problem;
- kinds: `gone` (this node's entry, nothing at its path: a notice, see `Problem`),
  `missing` (this node's entry, something other than a regular file at its path), `corrupt`,
  `size` / `checksum` (a file
  that verifies, and this node's entry of it disagrees), `stale_temp`, `orphan` (see
  `tiers.sharedfs.walk`).

`repair` looks at each keyed problem again, then: drops an entry without a file (`gone`,
`missing`); moves a
corrupt file to `.quarantine/` (as a read does) and drops this node's entry; replaces an entry
that disagrees with a sound file by one that matches the file (the untrusted entry goes, the
verified block stays and this node keeps accounting for it); deletes stale temps and orphans
(a symlink is unlinked, never followed).
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
import time
from pathlib import Path

from kvtier.store.base import block
from kvtier.store.base.errors import CorruptBlockError
from kvtier.store.base.index_record import Entry
from kvtier.tiers.base import Problem
from kvtier.tiers.files import check as check_files
from kvtier.tiers.files.check import (Ticker, batches, lstat_or_none,
                                      remove_path)
from kvtier.tiers.sharedfs import files
from kvtier.tiers.sharedfs.walk import junk_problem, list_leaf, walk_top

KEYED = ("missing", "gone", "corrupt", "size", "checksum")


def check(tier, progress=None) -> list[Problem]:
    """Every problem of the tier; changes nothing."""
    top = walk_top(tier)
    ticker = Ticker(progress, len(top.leaves) + tier.index.tier_usage(tier.name)[0])
    problems = top.problems
    for d in top.leaves:
        leaf = list_leaf(tier, d)
        entries = [e for e in tier.index.get(tier.name, list(leaf.blocks)) if e is not None]
        problems += leaf.problems + _check_blocks(tier, leaf.blocks, entries)[0]
        ticker.add(1)
    for page in tier.index.ready_pages(tier.name, check_files.PAGE_ENTRIES):
        for e in page:
            p = _entry_problem(tier, e, {}, {})  # blocks already verified: is there a file?
            if p is not None and _unchanged(tier, e):
                problems.append(p)
        ticker.add(len(page))
    return problems


def repair(tier, problems) -> int:
    """Fix what is still wrong of `problems`; return how many were fixed."""
    fixed = 0
    keys = sorted({p.key for p in problems if p.key and p.kind in KEYED})
    if keys:
        blocks = {}
        for key in keys:
            path = files.block_path(tier.root, key)
            st = lstat_or_none(path)
            if st is not None and files.is_file(path):
                blocks[key] = (path, st)
        entries = [e for e in tier.index.get(tier.name, keys) if e is not None]
        again, headers = _check_blocks(tier, blocks, entries)
        fixed += sum(_fix(tier, p, headers.get(p.key), blocks.get(p.key)) for p in again)
    now = time.time()
    for p in problems:
        if p.kind in ("orphan", "stale_temp") and p.path:
            path = Path(p.path)
            st = lstat_or_none(path)
            if st is not None and junk_problem(tier, path, st, now) is not None:
                fixed += remove_path(path, tier.root)
    return fixed


def sweep_quarantine(root: Path, older_than_s: float, dry_run: bool = False) -> int:
    """Delete (or count) quarantined frames moved aside more than `older_than_s` ago."""
    qdir, cutoff, n = Path(root) / files.QUARANTINE, time.time() - older_than_s, 0
    st = lstat_or_none(qdir)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return 0  # none yet, or a link in its place (an orphan that check reports)
    with os.scandir(qdir) as it:
        found = [Path(e.path) for e in it]
    for path in found:
        st = lstat_or_none(path)
        if st is not None and _quarantined_at(path.name, st) < cutoff:
            n += 1 if dry_run else remove_path(path, qdir)
    return n


def _quarantined_at(name: str, st: os.stat_result) -> float:
    """When a frame was moved aside: the time in its name (`<key>.<node>.<ns>.kvb`), else its
    ctime (a rename sets ctime; mtime is still the write's)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[2].isdigit():
        return int(parts[2]) / 1e9
    return st.st_ctime


def _check_blocks(tier, blocks, entries: list[Entry]):
    """(problems, {key: header of a sound file}) for block files and this node's entries."""
    headers, problems = _verify(tier, blocks)
    bad = {p.key for p in problems}
    for e in entries:
        if e.key in bad:
            continue  # corrupt: one problem per key, and repair drops the entry with it
        p = _entry_problem(tier, e, blocks, headers)
        if p is not None and _unchanged(tier, e):
            problems.append(p)
    return problems, headers


def _entry_problem(tier, e: Entry, blocks, headers) -> Problem | None:
    path = files.block_path(tier.root, e.key)
    if e.key not in blocks:
        if files.is_file(path):
            return None  # written after the walk
        if lstat_or_none(path) is None:
            # Every node may evict any file of a shared tier; this node's entry stays until
            # a read or a rescan meets the gap.
            return Problem("gone", tier.name, e.key, str(path),
                           "this node's index holds the block, its file is gone (another "
                           "node evicted it, or it was lost); reads miss and drop the entry")
        return Problem("missing", tier.name, e.key, str(path),
                       "this node's index holds the block, no regular file does")
    h = headers.get(e.key)
    if h is None:
        return None  # replaced or removed while it was read
    if h.frame_len != e.size:
        return Problem("size", tier.name, e.key, str(path),
                       f"the entry says {e.size} bytes, the file holds {h.frame_len}")
    if h.checksum != e.checksum:
        return Problem("checksum", tier.name, e.key, str(path),
                       f"the entry says {e.checksum:016x}, the file {h.checksum:016x}")
    return None


def _verify(tier, blocks):
    """Read and verify every block file: ({key: header}, corrupt problems)."""
    headers, problems = {}, []
    items = sorted(blocks.items())
    for batch in batches(items, lambda it: it[1][1].st_size):
        outs = [memoryview(bytearray(max(st.st_size, block.HEADER_SIZE)))
                for _, (_, st) in batch]
        reads = tier._loop.run(_read_all(tier, [path for _, (path, _) in batch], outs))
        for (key, (path, _)), out, (n, st, err) in zip(batch, outs, reads):
            if err is not None:
                if err.errno not in (errno.ENOENT, errno.ELOOP) and \
                        not isinstance(err, files.NotRegularFile):
                    problems.append(Problem("corrupt", tier.name, key, str(path),
                                            f"cannot be read ({err})"))
                continue  # gone or replaced by a link meanwhile: the next check sees it
            try:
                h = block.verify(out, key, length=n)
                if h.frame_len != st.st_size:
                    raise CorruptBlockError(f"the file holds {st.st_size} bytes, its frame "
                                            f"{h.frame_len}")
                headers[key] = h
            except CorruptBlockError as e:
                if _same_file(path, st):
                    problems.append(Problem("corrupt", tier.name, key, str(path), str(e)))
    return headers, problems


async def _read_all(tier, paths, outs):
    return await asyncio.gather(*(files.read_block(tier._aiofiles, p, o)
                                  for p, o in zip(paths, outs)))


def _same_file(path: Path, st) -> bool:
    now = lstat_or_none(path)
    return now is not None and (now.st_ino, now.st_dev, now.st_size) == \
        (st.st_ino, st.st_dev, st.st_size)


def _unchanged(tier, e: Entry) -> bool:
    now = tier.index.get(tier.name, [e.key])[0]
    return now is not None and (now.created, now.size, now.checksum) == \
        (e.created, e.size, e.checksum)


def _fix(tier, p: Problem, header, seen) -> int:
    """Repair one keyed problem found again just now (`seen`: (path, lstat) before that)."""
    if p.kind == "corrupt" and seen is not None:
        # Only the file we verified: a sound copy renamed over it since stays.
        files.quarantine(tier.root, seen[0], p.key, tier.node, seen[1])
    tier._forget_keys([p.key])
    if p.kind in ("size", "checksum") and header is not None:
        # The entry was wrong, the file verifies: account for the file as it is.
        e = Entry(p.key, tier.name, size=header.frame_len, checksum=header.checksum,
                  created=time.time())
        if tier.index.reserve([e])[0]:
            tier.index.commit(tier.name, [p.key])
            tier._ages.add([e])
    return 1
