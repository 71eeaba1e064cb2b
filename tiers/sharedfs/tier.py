"""The sharedfs tier: one file per block on a filesystem every node mounts (NFS, Lustre, 3FS).

Files (see `tiers.sharedfs.files`): `root/ab/cd/<key>.kvb`, written to a temp file, fsynced
(policy `fsync`) and renamed, so readers never see a partial frame and two nodes writing one
key is safe. Reads go through `aiofiles`, a batch concurrently, on a private event loop thread.
Any node reads any node's blocks: `get` and `contains` look at the files, not at the index.

Accounting: this node's writes are recorded in its LMDB index (reserve -> write -> commit), so
`used_bytes()` is what this node stored, exactly and cheaply. `capacity` is this node's share
of the shared directory (set it to the share each node may use). `rescan()` walks the whole
tree for the total of all nodes and drops entries of files other nodes removed.

When full: the tier evicts FIFO by index age among this node's own files (oldest first),
like the nvme tier reclaims its oldest region; other nodes' files are never evicted by this
node. The capacity is a soft limit: processes of one node evicting at the same moment may
overshoot it by the batches they have in flight. TierFullError (with `.stored`) is raised only
when the filesystem says ENOSPC or a batch exceeds the whole capacity; the failed block's temp
file is removed, so nothing is torn, and reads keep working.

Every read verifies the frame; a corrupt file (or a symlink in its place) is counted, moved to
`root/.quarantine/` and reported as MISS. A file some other node removed is a plain miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Sequence

from kvtier.store.base import block
from kvtier.store.base.config import SharedFSTierConfig
from kvtier.store.base.errors import (ConfigError, CorruptBlockError, TierError,
                                     TierUnavailableError)
from kvtier.store.base.index_record import PENDING, READY, Entry, owner_alive
from kvtier.tiers.base import TierContext
from kvtier.tiers.base import MISS, Tier, full_error
from kvtier.tiers.bounded import BoundedCalls, Unanswered
from kvtier.tiers.files.buffers import checked_header
from kvtier.tiers.files.paths import prepare_tier_dir
from kvtier.tiers.sharedfs import check as sharedfs_check
from kvtier.tiers.sharedfs import files
from kvtier.tiers.sharedfs.aioloop import LoopThread
from kvtier.tiers.sharedfs.fifo import AgeQueue, created_ns

log = logging.getLogger(__name__)
IO_THREADS = 16  # concurrent file operations per batch: enough to hide NFS round trips
LOOKUP_THREADS = 2  # lookups in flight at once (one may hang on a mount whose server is gone)
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# The filesystem itself is gone (a network mount whose servers or link went away, a FUSE
# client killed): the tier is unavailable for now, its blocks are not missing.
_GONE_ERRNOS = frozenset({errno.ENOTCONN, errno.ESTALE, errno.EIO, errno.EHOSTDOWN,
                          errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.ECONNREFUSED,
                          errno.ECONNABORTED, errno.ECONNRESET, errno.ENODEV})


def _aiofiles():
    try:
        import aiofiles
    except ImportError:
        raise ConfigError("the sharedfs tier needs the `aiofiles` package: "
                          "`pip install aiofiles`") from None
    return aiofiles


class SharedFSTier(Tier):
    kind = "sharedfs"

    def __init__(self, cfg: SharedFSTierConfig, ctx: TierContext):
        super().__init__(cfg.name, cfg.capacity_bytes)
        self._aiofiles = _aiofiles()
        self.cfg, self.index = cfg, ctx.index
        self.root = prepare_tier_dir(Path(cfg.path), cfg.name, self.kind)
        self.node = re.sub(r"[^A-Za-z0-9_-]", "_", ctx.node_id)[:64] or "node"
        self._dirs = files.DirCache(self.root)
        self._ages = AgeQueue(ctx.index, cfg.name)
        self._loop = LoopThread(f"kvtier-{cfg.name}", IO_THREADS)
        # Lookups run on the scheduler's thread: a hung mount must cost them a timeout once.
        self._lookups = BoundedCalls(cfg.name, LOOKUP_THREADS, cfg.call_timeout_s)
        self._stop = threading.Event()
        self._closed = False
        if ctx.recover:  # a check opens without it: it must see the leftovers (sharedfs_check)
            self.index.recover()
            self._sweep = self._loop.call(self._sweep_logged)

    # ---- the contract ------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        try:
            return self._lookups.run(self._exist, list(keys))
        except Unanswered as e:
            what = (f"had no answer within {self.cfg.call_timeout_s:g}s (call_timeout_s)"
                    if e.waited else "waits behind an earlier one that has not answered")
            raise TierUnavailableError(
                f"sharedfs tier {self.name!r}: a lookup under {self.root} {what}: the "
                "filesystem hangs (a network mount whose server is gone?); its blocks are "
                "skipped until it answers") from None

    def _exist(self, keys: list[str]) -> list[bool]:
        with self._reachable():
            return [files.is_file(files.block_path(self.root, k)) for k in keys]

    def put(self, keys: Sequence[str], frames: Sequence[memoryview]) -> list[bool]:
        self._check_open()
        headers = [checked_header(k, f) for k, f in zip(keys, frames)]
        results = [False] * len(keys)
        with self._reachable():
            todo, dups = self._to_write(keys, results)
        fit, need = [], 0
        for i in todo:  # a batch larger than the whole capacity stores what fits
            if need + headers[i].frame_len > self.capacity_bytes:
                break
            fit.append(i)
            need += headers[i].frame_len
        if fit:
            with self._reachable():
                self._make_room(need)
        enospc = self._write(keys, frames, headers, fit, results) if fit else False
        for dup, first in dups.items():
            results[dup] = results[first]
        if enospc or len(fit) < len(todo):
            why = (f"the filesystem under {self.root} is full (ENOSPC)" if enospc else
                   f"the batch is larger than its capacity of {self.capacity_bytes} bytes")
            raise full_error(self.name, why, "free space there or raise the tier's capacity",
                             [k for k, ok in zip(keys, results) if ok])
        return results

    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int]:
        self._check_open()
        reads = self._loop.run(self._read_all(keys, outs))
        results, gone = [MISS] * len(keys), []
        for i, (key, (nread, st, err)) in enumerate(zip(keys, reads)):
            if err is not None:
                self._read_failed(key, st, err, gone)
                continue
            try:
                h = block.verify(outs[i], key, length=nread)
                if h.frame_len != st.st_size:
                    raise CorruptBlockError(f"file holds {st.st_size} bytes, the frame "
                                            f"{h.frame_len}")
            except CorruptBlockError as e:
                _check_room(key, outs[i], nread, st.st_size)
                self._quarantine(key, st, str(e))
                continue
            results[i] = h.payload_len
        self._forget_keys(gone)
        self.stats.add_reads(results)
        return results

    def delete(self, keys: Sequence[str]) -> int:
        """Remove the blocks' files (whichever node wrote them) and this node's entries."""
        self._check_open()
        self._ages.remove(self.index.delete(self.name, keys))
        with self._reachable():
            removed = sum(files.unlink_block(files.block_path(self.root, k)) for k in keys)
        self.stats.add(deletes=removed)
        return removed

    def used_bytes(self) -> int:
        return self.index.tier_usage(self.name)[1]

    @contextlib.contextmanager
    def _reachable(self):
        """Raise `TierUnavailableError` (one line, the cause and the fix) where the
        filesystem under the root is gone, instead of the OSError of the first file."""
        try:
            yield
        except OSError as e:
            if e.errno not in _GONE_ERRNOS:
                raise
            raise TierUnavailableError(
                f"sharedfs tier {self.name!r}: the filesystem under {self.root} is not "
                f"reachable ({e.strerror}); check its mount and the network to its "
                "servers (its blocks are skipped until it answers)") from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._lookups.close()
        self._loop.close()

    # ---- maintenance -------------------------------------------------------------------

    def rescan(self, prune: bool = True) -> tuple[int, int]:
        """(files, bytes) under the root from every node; with `prune`, drop this node's
        index entries whose files are gone (deleted or evicted by another node)."""
        self._check_open()
        with self._reachable():
            total = files.scan(self.root)
            if prune:
                mine = [e.key for e in self.index.scan(self.name, states=(READY,))]
                self._forget_keys([k for k in mine
                                   if not files.is_file(files.block_path(self.root, k))])
        return total

    def check(self, progress=None):
        return sharedfs_check.check(self, progress)

    def repair(self, problems) -> int:
        return sharedfs_check.repair(self, problems)

    def sweep_quarantine(self, older_than_s: float, dry_run: bool = False) -> int:
        """Delete quarantined frames older than `older_than_s` (`inspect gc`)."""
        return sharedfs_check.sweep_quarantine(self.root, older_than_s, dry_run)

    def sweep_temps(self) -> int:
        """Delete temp files older than `stale_temp_after_s` (left by crashed writers)."""
        return files.sweep_temps(self.root, self.cfg.stale_temp_after_s, self._stop)

    def _sweep_logged(self) -> int:
        n = self.sweep_temps()
        if n:
            log.info("sharedfs tier %r: removed %d stale temp files", self.name, n)
        return n

    # ---- writes ------------------------------------------------------------------------

    def _to_write(self, keys: Sequence[str], results: list[bool]):
        """(indexes to write, {duplicate index: first index}); marks present keys True."""
        entries = self.index.get(self.name, keys, ready_only=False)
        todo, first, dups, stale = [], {}, {}, []
        for i, (key, e) in enumerate(zip(keys, entries)):
            if key in first:
                dups[i] = first[key]
            elif files.is_file(files.block_path(self.root, key)):
                results[i] = True
            elif e is not None and e.state == PENDING and owner_alive(e.owner_pid, e.created):
                results[i] = True  # another process of this node is writing it right now
            else:
                if e is not None:
                    stale.append(key)  # our entry, but another node removed the file
                first[key] = i
                todo.append(i)
        self._forget_keys(stale)
        return todo, dups

    def _write(self, keys, frames, headers, idx, results) -> bool:
        """Reserve, write and commit `idx`; return True if the filesystem ran out of space."""
        now = time.time()
        entries = [Entry(keys[i], self.name, size=headers[i].frame_len,
                         checksum=headers[i].checksum, created=now) for i in idx]
        reserved = self.index.reserve(entries)
        mine = [j for j, ok in enumerate(reserved) if ok]
        for j, ok in enumerate(reserved):
            results[idx[j]] = not ok  # not ok: this node stored it meanwhile
        try:
            errs = self._loop.run(self._write_all(
                [(keys[idx[j]], frames[idx[j]], headers[idx[j]].frame_len) for j in mine]))
        except BaseException:
            # e.g. a link planted as a fan-out directory: a reservation left behind would
            # read as "being written by a live process" until this process exits.
            self.index.abort(self.name, [entries[j].key for j in mine])
            raise
        done = [entries[j] for j, err in zip(mine, errs) if err is None]
        failed = [entries[j].key for j, err in zip(mine, errs) if err is not None]
        if failed:
            self.index.abort(self.name, failed)
        self.index.commit(self.name, [e.key for e in done])
        self._ages.add(done)
        for j, err in zip(mine, errs):
            results[idx[j]] = err is None
        full = [e for e in errs if e is not None and e.errno in _FULL_ERRNOS]
        other = [e for e in errs if e is not None and e.errno not in _FULL_ERRNOS]
        self.stats.add(puts=len(done), errors=len(other), bytes_in=sum(e.size for e in done))
        if other:
            log.warning("sharedfs tier %r: %d writes failed (%s)", self.name, len(other),
                        other[0])
        return bool(full)

    async def _write_all(self, items) -> list[OSError | None]:
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(None, self._write_one, *it)
                                      for it in items))

    def _write_one(self, key: str, frame: memoryview, frame_len: int) -> OSError | None:
        path = files.block_path(self.root, key)
        for attempt in range(2):
            try:
                self._dirs.ensure(path.parent)
                files.write_block(path, memoryview(frame)[:frame_len], self.cfg.file_mode,
                                  self.cfg.fsync, f"{self.node}.{os.getpid()}")
                return None
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    return e
                # Another node pruned the directory (redo it), or a link was planted where
                # it was (the second `ensure` refuses it with a TierError).
                self._dirs.forget(path.parent)
                err = e
        return err

    def _make_room(self, need: int) -> None:
        """Evict this node's oldest files until `need` more bytes fit under the capacity.

        Best effort: processes of one node evicting at once may each see the other's victims
        still counted, so the capacity is a soft limit, overshot at most by batches in flight.
        """
        for _ in range(8):
            deficit = self.used_bytes() + need - self.capacity_bytes
            if deficit <= 0:
                return
            victims = self._ages.pop_oldest(deficit)
            if not victims:
                return
            entries = self.index.get(self.name, [k for _, k in victims])
            old = [e.key for (ns, _), e in zip(victims, entries)
                   if e is not None and created_ns(e) == ns]
            # Files go only after the index transaction has dropped their entries.
            for e in self.index.delete(self.name, old):
                files.unlink_block(files.block_path(self.root, e.key))

    # ---- reads -------------------------------------------------------------------------

    async def _read_all(self, keys, outs):
        return await asyncio.gather(*(files.read_block(self._aiofiles,
                                                       files.block_path(self.root, k), o)
                                      for k, o in zip(keys, outs)))

    def _read_failed(self, key: str, st, err: OSError, gone: list[str]) -> None:
        if err.errno == errno.ENOENT:
            gone.append(key)  # never written, or removed by another node: a plain miss
        elif err.errno in (errno.ELOOP, errno.ENOTDIR) or isinstance(err, files.NotRegularFile):
            self._quarantine(key, st, "a symlink or special file where a block belongs")
        else:
            self.stats.add(errors=1)
            log.warning("sharedfs tier %r: read of %s failed (%s)", self.name, key, err)

    def _quarantine(self, key: str, st, why: str) -> None:
        moved = files.quarantine(self.root, files.block_path(self.root, key), key, self.node, st)
        self._forget_keys([key])
        self.stats.add(corrupt=1)
        log.warning("sharedfs tier %r: block %s is corrupt (%s); %s", self.name, key, why,
                    "moved to .quarantine" if moved else "already replaced or removed")

    def _forget_keys(self, keys: Sequence[str]) -> None:
        if keys:
            self._ages.remove(self.index.delete(self.name, keys))

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"sharedfs tier {self.name!r} is closed; open it again")


def _check_room(key: str, out: memoryview, nread: int, file_size: int) -> None:
    """Raise ValueError if a sound frame only failed because the caller's buffer is short:
    that is a caller bug, and quarantining the block for it would destroy good data."""
    if nread >= file_size:
        return
    try:
        h = block.parse_header(out)
    except CorruptBlockError:
        return
    if h.key == key and h.frame_len == file_size:
        raise ValueError(f"out buffer of {len(out)} bytes is too small for block {key} "
                         f"({h.frame_len} bytes); size buffers by the namespace's frame")
