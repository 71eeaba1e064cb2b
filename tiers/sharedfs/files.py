"""The file layer of the sharedfs tier: paths, atomic writes, quarantine, sweeps, scans.

Layout under the tier root:
- `ab/cd/<key>.kvb`: one sealed frame per file; `ab` and `cd` are the first four hex digits of
  the key's chain hash (not of its namespace, which every block of a model shares), so blocks
  spread over 65,536 directories.
- `ab/cd/.<key>.kvb.<node>.<pid>.<random>.tmp`: a write in progress; renamed over the final
  name when complete, so a reader sees the whole frame or no file. Two nodes writing the same
  key each rename a complete file; the last rename wins and both files hold the same bytes.
  Temps older than `stale_temp_after_s` were left by a crash and are swept.
- `.quarantine/<key>.<node>.<ns>.kvb`: frames that failed verification, moved aside for a
  human to look at; nothing reads them.

Safety: directories are created 0700 and files `file_mode` (0600). Every read, delete and
quarantine walks from the root one component at a time with O_NOFOLLOW (`leaf_dir_fd`), and
writes check fan-out directories with lstat on first use, so a symlink planted in the tree, in
place of a block or of a directory, is refused, never followed: nothing outside the root is
read, moved or removed through it. Keys are validated hex, so no name can escape the root.
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import stat
import threading
import time
from pathlib import Path

from kvtier.store.base.errors import TierError
from kvtier.store.base.keys import NS_HEX, check_key

SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
QUARANTINE = ".quarantine"
DIR_MODE = 0o700


def block_path(root: Path, key: str) -> Path:
    """Where `key` lives under `root`; ValueError for anything but a block key (so no
    string handed to a tier becomes a path outside the root)."""
    chain = check_key(key)[NS_HEX:]
    return root / chain[:2] / chain[2:4] / (key + SUFFIX)


def leaf_dir_fd(path: Path) -> int:
    """An O_PATH descriptor of the fan-out directory of block file `path`, reached from the
    tier root one component at a time with O_NOFOLLOW: a link planted in place of `ab` or
    `cd` raises OSError (ELOOP or ENOTDIR) instead of leading out of the tree."""
    fd = os.open(path.parents[2], os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in (path.parent.parent.name, path.parent.name):
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def nofollow_opener(path: str, flags: int) -> int:
    """`open(..., opener=)` hook: follow no symlink below the tier root (file or directory)."""
    dfd = leaf_dir_fd(Path(path))
    try:
        return os.open(os.path.basename(path), flags | os.O_NOFOLLOW | os.O_CLOEXEC,
                       dir_fd=dfd)
    finally:
        os.close(dfd)


def unlink_block(path: Path) -> bool:
    """Remove block file `path` without following a link on the way; True if removed.
    Under a planted directory link there is no block of ours to remove: False."""
    try:
        dfd = leaf_dir_fd(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        if e.errno == errno.ELOOP:
            return False
        raise
    try:
        os.unlink(path.name, dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)


class NotRegularFile(OSError):
    """A directory, fifo or device sits where a block file belongs."""


def is_file(path: Path) -> bool:
    """True for a regular file at `path` (a symlink there is not one)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


async def read_block(aiofiles, path: Path, out: memoryview):
    """Read the file at `path` into `out` with aiofiles: (bytes read, fstat or None, OSError
    or None). Reads at most len(out) bytes; the caller compares with the file size."""
    loop, st = asyncio.get_running_loop(), None
    try:
        async with aiofiles.open(path, "rb", buffering=0, opener=nofollow_opener) as f:
            st = await loop.run_in_executor(None, os.fstat, f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return 0, st, NotRegularFile(errno.EINVAL, "not a regular file")
            view, done = memoryview(out)[:min(st.st_size, len(out))], 0
            while done < len(view):
                n = await f.readinto(view[done:])
                if not n:
                    break  # the file shrank under us: verification will say truncated
                done += n
            return done, st, None
    except OSError as e:
        return 0, st, e


class DirCache:
    """Fan-out directories known to exist as real directories in this process."""

    def __init__(self, root: Path):
        self.root = root
        self._known: set[Path] = set()
        self._lock = threading.Lock()

    def ensure(self, leaf: Path) -> None:
        if leaf in self._known:
            return
        for d in (leaf.parent, leaf):
            try:
                os.mkdir(d, DIR_MODE)
            except FileExistsError:
                pass  # made by another process or node, or by us earlier
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode):
                raise TierError(f"sharedfs: {d} is not a plain directory (a symlink?); remove "
                                "it, kvtier never follows links in its tree")
        with self._lock:
            self._known.add(leaf)

    def forget(self, leaf: Path) -> None:
        """Check `leaf` again next time (someone removed it, e.g. a cleanup of empty dirs)."""
        with self._lock:
            self._known.discard(leaf)


def write_block(path: Path, frame: memoryview, file_mode: int, fsync: bool, tag: str) -> None:
    """Write `frame` to a temp file beside `path`, fsync it, rename it over `path`, all inside
    the fan-out directory reached without following links (`leaf_dir_fd`).

    Raises OSError (ENOSPC included; ENOTDIR or ELOOP for a planted link) with no temp file
    left behind.
    """
    tmp = f".{path.name}.{tag}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    dfd = leaf_dir_fd(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     file_mode, dir_fd=dfd)
        try:
            os.fchmod(fd, file_mode)  # exact mode whatever the umask says
            view, done = memoryview(frame), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        _unlink_quietly(tmp, dfd)
        raise
    finally:
        os.close(dfd)


def _unlink_quietly(name: str, dfd: int) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass


def quarantine(root: Path, path: Path, key: str, node: str, seen: os.stat_result | None) -> bool:
    """Move the file at `path` aside, unless it was replaced since we read it (then keep it).
    A link planted in place of a fan-out directory is what gets moved: nothing behind a link
    is ever touched. Returns True if something was moved.
    """
    qdir = root / QUARANTINE
    try:
        dfd = leaf_dir_fd(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        return _quarantine_planted_dir(root, path, key, node)
    try:
        try:
            now = os.lstat(path.name, dir_fd=dfd)
        except FileNotFoundError:
            return False
        if seen is not None and (now.st_ino, now.st_dev) != (seen.st_ino, seen.st_dev):
            return False  # a writer renamed a fresh copy over the bad one: leave that alone
        qdir.mkdir(mode=DIR_MODE, exist_ok=True)
        try:
            os.rename(path.name, qdir / f"{key}.{node}.{time.time_ns()}{SUFFIX}",
                      src_dir_fd=dfd)
        except FileNotFoundError:
            return False  # another node moved or deleted it first
        return True
    finally:
        os.close(dfd)


def _quarantine_planted_dir(root: Path, path: Path, key: str, node: str) -> bool:
    """Move aside the link or file that sits where fan-out directory `ab` or `ab/cd` of
    `path` belongs (renaming a link moves the link, never its target)."""
    for d in (path.parent.parent, path.parent):
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            (root / QUARANTINE).mkdir(mode=DIR_MODE, exist_ok=True)
            try:
                os.rename(d, root / QUARANTINE / f"dir-{d.name}.{key}.{node}.{time.time_ns()}")
            except FileNotFoundError:
                return False
            return True
    return False


def fanout_dirs(root: Path):
    """Every leaf fan-out directory under `root` (skips dot entries and non-directories)."""
    for top in _subdirs(root):
        yield from _subdirs(top)


def _subdirs(d: Path):
    try:
        with os.scandir(d) as it:
            entries = [e for e in it if len(e.name) == 2 and not e.name.startswith(".")
                       and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    for e in entries:
        yield Path(e.path)


def sweep_temps(root: Path, older_than_s: float, stop: threading.Event | None = None) -> int:
    """Delete temp files older than `older_than_s` (crashed writers); return how many."""
    cutoff, removed = time.time() - older_than_s, 0
    for d in fanout_dirs(root):
        if stop is not None and stop.is_set():
            break
        with os.scandir(d) as it:
            temps = [e for e in it if e.name.startswith(".") and e.name.endswith(TEMP_SUFFIX)]
        for e in temps:
            try:
                if e.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(e.path)
                    removed += 1
            except FileNotFoundError:
                continue  # its writer renamed it, or another node swept it
    return removed


def scan(root: Path) -> tuple[int, int]:
    """(files, bytes) of every block file under `root`, written by any node."""
    files = nbytes = 0
    for d in fanout_dirs(root):
        with os.scandir(d) as it:
            for e in it:
                if e.name.startswith(".") or not e.name.endswith(SUFFIX):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    files, nbytes = files + 1, nbytes + st.st_size
    return files, nbytes
