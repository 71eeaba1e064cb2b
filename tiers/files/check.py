"""Helpers the file tiers' checks share: probe files, removal of untrusted paths, progress.

Guarantees:
- `remove_path` removes only paths inside the tier root it is given, and never follows a
  symlink: a link is unlinked, never its target; a directory is removed with `shutil.rmtree`,
  which does not follow links inside it either.
- `probe_problem` calls a start-up probe file (`tiers.files.paths.prepare_tier_dir` makes and
  removes one at every open, for microseconds) a leftover only once it is `PROBE_STALE_S` old,
  so a check never reports another process's open in progress.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

from kvtier.tiers.base import Problem

PROBE_PREFIX = ".kvtier-probe-"
PROBE_STALE_S = 60.0
READ_BATCH_BYTES = 64 << 20  # bytes read back per batch: bounds a check's memory
PAGE_ENTRIES = 16384  # index entries a check takes per page (one read transaction each)


def probe_problem(tier: str, path: Path, st: os.stat_result, now: float) -> Problem | None:
    """A `stale_temp` problem for an old probe file; None for a fresh one."""
    age = now - st.st_mtime
    if age < PROBE_STALE_S:
        return None
    return Problem("stale_temp", tier, path=str(path),
                   detail=f"a start-up probe file {age:.0f}s old (its process crashed)")


def describe(st: os.stat_result) -> str:
    """What a path that does not belong is, in words an operator can act on."""
    if stat.S_ISLNK(st.st_mode):
        return "a symlink (kvtier never follows links in its tree)"
    if stat.S_ISDIR(st.st_mode):
        return "a directory kvtier did not make"
    if not stat.S_ISREG(st.st_mode):
        return "a special file (fifo, socket or device)"
    return "a file kvtier did not write"


def remove_path(path: Path, root: Path) -> bool:
    """Remove the file, link or directory tree at `path` (inside `root`); False if gone."""
    path, root = Path(path), Path(root)
    if path == root or not path.is_relative_to(root):
        raise ValueError(f"refusing to remove {path}: it is not inside the tier root {root}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return False  # another process removed it first
    return True


def lstat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def batches(items: list, size_of, max_bytes: int = READ_BATCH_BYTES, max_items: int = 256):
    """Split `items` into lists of at most `max_items` and about `max_bytes` (one item
    larger than `max_bytes` still makes a batch of its own)."""
    batch, nbytes = [], 0
    for item in items:
        n = size_of(item)
        if batch and (nbytes + n > max_bytes or len(batch) >= max_items):
            yield batch
            batch, nbytes = [], 0
        batch.append(item)
        nbytes += n
    if batch:
        yield batch


class Ticker:
    """Calls `progress(done, total)` as a scan advances (at most ten times a second)."""

    def __init__(self, progress, total: int):
        self.progress, self.total, self.done = progress, total, 0
        self._last = 0.0
        if progress is not None:
            progress(0, total)

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.progress is not None and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            self.progress(self.done, self.total)
