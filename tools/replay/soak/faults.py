"""The file faults of `kvtier replay --soak`: a small disk, a balloon that fills it, and bit
flips or truncation of stored frames, done from outside the store as a failing disk would.

- `SoakDisk(where, size_bytes)`: the soak's nvme dirs and shared dir live on a tmpfs of
  `size_bytes` mounted at `where`, so that the disk can be filled without touching the
  machine's own disks. Mounting needs root: when it cannot be done, `where` stays a plain
  directory and `skipped` says why (the disk-full fault is then skipped, and reported so).
  `close()` unmounts (lazily if something still holds it); call it in a `finally`.
- `Balloon(where)`: `fill()` writes one file until the filesystem says ENOSPC, so every
  writer of that disk sees it full; `pop()` removes it.
- `corrupt_block_file(root, rng)`: a random sharedfs block file, bits flipped or truncated.
- `corrupt_frame(path, offset, size, rng)`: bits flipped inside one frame of a file (a frame
  of the nvme data file).
Each corruption returns (key or None, what was done); the caller decides what to check.
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
from pathlib import Path

from kvtier.store.base.block import HEADER_SIZE
from kvtier.tiers.sharedfs.files import SUFFIX as BLOCK_SUFFIX  # <root>/ab/cd/<key>.kvb



class SoakDisk:
    """A tmpfs for the soak's tier directories, or a plain directory when it cannot be."""

    def __init__(self, where: Path, size_bytes: int):
        self.where, self.size_bytes = where, size_bytes
        self.mounted = False
        self.skipped: str | None = None
        where.mkdir(parents=True, exist_ok=True)
        if os.path.ismount(where):  # left by a soak that could not clean up: start afresh
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
        if os.geteuid() != 0:
            self.skipped = "not root: a tmpfs cannot be mounted, the tier dirs are on the " \
                           "machine's disk, which the soak will not fill"
            return
        done = subprocess.run(["mount", "-t", "tmpfs", "-o",
                               f"size={size_bytes},mode=0700", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            self.skipped = f"mounting a tmpfs at {where} failed: " \
                           f"{(done.stderr or done.stdout).strip() or done.returncode}"
            return
        self.mounted = True

    def close(self) -> None:
        """Unmount (idempotent); a lazy unmount if a process still holds a file there."""
        if not self.mounted:
            return
        self.mounted = False
        if subprocess.run(["umount", str(self.where)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(self.where)], capture_output=True)

    def __enter__(self) -> "SoakDisk":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Balloon:
    """One file that takes every free byte of a filesystem while it is inflated."""

    def __init__(self, where: Path):
        self.path = where / "balloon"
        self.bytes = 0

    @property
    def inflated(self) -> bool:
        return self.path.exists()

    def fill(self) -> int:
        """Write until ENOSPC; returns the bytes it took."""
        chunk = b"\0" * (1 << 20)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while True:
                try:
                    n = os.write(fd, chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 4096:
                        break
                    chunk = chunk[:4096]  # the last pages
                    continue
                self.bytes += n
        finally:
            os.close(fd)
        return self.bytes

    def pop(self) -> None:
        self.path.unlink(missing_ok=True)
        self.bytes = 0


def block_files(root: Path) -> list[Path]:
    """The block files under a sharedfs root (no temps, nothing quarantined)."""
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        out += [Path(d) / n for n in names
                if n.endswith(BLOCK_SUFFIX) and not n.startswith(".")]
    return out


def corrupt_block_file(root: Path, rng: random.Random) -> tuple[str | None, str]:
    """Flip bits in, or truncate, one random block file under `root`."""
    files = block_files(root)
    if not files:
        return None, "no block file to corrupt"
    path = rng.choice(sorted(files))
    key = path.name[:-len(BLOCK_SUFFIX)]
    try:
        size = path.stat().st_size
        if rng.random() < 0.5:
            cut = rng.randrange(0, max(size, 1))
            os.truncate(path, cut)
            return key, f"truncated {path.name} from {size} to {cut} bytes"
        flipped = _flip(path, 0, size, rng)
    except FileNotFoundError:  # evicted since the listing
        return None, f"{path.name} went away before it could be corrupted"
    return key, f"flipped {flipped} bits of {path.name}"


def corrupt_frame(path: str, offset: int, size: int, rng: random.Random) -> str:
    """Flip bits of the frame of `size` bytes at `offset` of `path`."""
    return f"flipped {_flip(Path(path), offset, size, rng)} bits of the frame at " \
           f"offset {offset} of {Path(path).name}"


def _flip(path: Path, offset: int, size: int, rng: random.Random) -> int:
    """Flip one bit in each of 1-8 random bytes of [offset, offset + size), the header's
    bytes in a third of the cases (a reader must catch both)."""
    span = min(HEADER_SIZE if rng.random() < 1 / 3 else size, size)
    spots = rng.sample(range(span), min(rng.randint(1, 8), span))  # distinct: none undone
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        for at in spots:
            at += offset
            old = os.pread(fd, 1, at)
            if len(old) == 1:
                os.pwrite(fd, bytes([old[0] ^ (1 << rng.randrange(8))]), at)
    finally:
        os.close(fd)
    return len(spots)
