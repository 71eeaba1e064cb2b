"""The tree walk of a sharedfs check: which paths are blocks, which are junk (no I/O beyond
`scandir` and `lstat`).

Layout (`tiers.sharedfs.files`): fan-out directories `ab/cd/` under the root, block files
`<key>.kvb` in the fan-out directory the key's chain names, temps `.<key>.kvb.<node>.<pid>.
<random>.tmp` beside them, `.quarantine/` and start-up probe files at the root.

Guarantees: a temp is `stale_temp` only when older than `stale_temp_after_s`, or when this
node wrote it and its writer pid is gone (a temp of a live writer is a write in flight); a
fresh probe file is another process's open in progress, never a problem; anything else that
is not a well-named regular block file in its own fan-out directory is an `orphan` (symlinks
included: kvtier never follows one). Which node wrote a block file cannot be known and does
not matter: a file that verifies is a block, whoever wrote it.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.store.base.index_record import owner_alive
from kvtier.store.base.keys import is_key
from kvtier.tiers.base import Problem
from kvtier.tiers.files.check import PROBE_PREFIX, describe, lstat_or_none, probe_problem
from kvtier.tiers.sharedfs.files import QUARANTINE, SUFFIX, TEMP_SUFFIX, block_path

ROOT_DIRS = (QUARANTINE, "lost+found")  # expected at the root (lost+found: a mount's own)
_HEX2 = frozenset("0123456789abcdef")


@dataclass
class Listing:
    blocks: dict[str, tuple[Path, os.stat_result]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    leaves: list[Path] = field(default_factory=list)  # fan-out directories to list next


def walk_top(tier) -> Listing:
    """The fan-out directories under the tier's root, and the junk above them (a tree of
    millions of files is then listed one leaf at a time: memory stays one leaf's worth)."""
    out, now = Listing(), time.time()
    for path, st in _entries(tier.root):
        if path.name in ROOT_DIRS and stat.S_ISDIR(st.st_mode):
            continue
        if _fanout(path, st):
            for sub, sst in _entries(path):
                if _fanout(sub, sst):
                    out.leaves.append(sub)
                else:
                    out.problems.append(junk_problem(tier, sub, sst, now))
        else:
            out.problems.append(junk_problem(tier, path, st, now))
    out.problems = [p for p in out.problems if p is not None]
    return out


def list_leaf(tier, d: Path) -> Listing:
    """The block files of one fan-out directory, and its junk."""
    out, now = Listing(), time.time()
    for path, st in _entries(d):
        key = block_key(path.name)
        if key is not None and stat.S_ISREG(st.st_mode) and block_path(tier.root, key) == path:
            out.blocks[key] = (path, st)
        else:
            p = junk_problem(tier, path, st, now)
            if p is not None:
                out.problems.append(p)
    return out


def junk_problem(tier, path: Path, st: os.stat_result, now: float) -> Problem | None:
    """The problem a path that is not a block file is (None: a write or an open in flight)."""
    name, regular = path.name, stat.S_ISREG(st.st_mode)
    if regular and name.startswith(PROBE_PREFIX) and path.parent == tier.root:
        return probe_problem(tier.name, path, st, now)
    if regular and name.startswith(".") and name.endswith(TEMP_SUFFIX):
        why = stale_temp(tier, name, st, now)
        key = block_key(name[1:].split(SUFFIX)[0] + SUFFIX)
        return None if why is None else Problem("stale_temp", tier.name, key, str(path), why)
    key = block_key(name)
    what = describe(st)
    if regular and key is not None:
        what = "a block file outside the directory its key names (never read)"
    elif regular:
        what = "a file whose name is no block key"
    return Problem("orphan", tier.name, key, str(path), what)


def stale_temp(tier, name: str, st: os.stat_result, now: float) -> str | None:
    """Why the temp file `name` is a crashed writer's leftover, or None if it may be live."""
    age = now - st.st_mtime
    if age > tier.cfg.stale_temp_after_s:
        return f"a temp file {age:.0f}s old (stale_temp_after_s is " \
               f"{tier.cfg.stale_temp_after_s:.0f})"
    parts = name[1:-len(TEMP_SUFFIX)].split(".")  # key, "kvb", node, pid, random
    if len(parts) == 5 and parts[2] == tier.node and parts[3].isdigit():
        pid = int(parts[3])
        if not owner_alive(pid, st.st_mtime):
            return f"a temp file of writer pid {pid} of this node, which is gone"
    return None


def block_key(name: str) -> str | None:
    """The key a block file's name carries, or None."""
    if name.startswith(".") or not name.endswith(SUFFIX):
        return None
    key = name[:-len(SUFFIX)]
    return key if is_key(key) else None


def _fanout(path: Path, st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and len(path.name) == 2 and set(path.name) <= _HEX2


def _entries(d: Path) -> list[tuple[Path, os.stat_result]]:
    """(path, lstat) of each entry of `d`; entries removed meanwhile are left out."""
    try:
        with os.scandir(d) as it:
            paths = [Path(e.path) for e in it]
    except FileNotFoundError:
        return []  # pruned by another node meanwhile
    out = []
    for p in paths:
        st = lstat_or_none(p)
        if st is not None:
            out.append((p, st))
    return out
