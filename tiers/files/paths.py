"""Start-up checks of a file tier's directory, with one-line errors that name path and fix.

A tier directory is created only when its parent exists: a missing parent usually means a disk
or a shared filesystem that is not mounted, and silently creating the path on the root disk
would fill the wrong device. Writability is probed by creating a file, because `access()`
says yes to root on a directory it cannot write (a read-only mount answers EROFS only to a
real write).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from kvtier.store.base.errors import TierUnavailableError

DIR_MODE = 0o700


def prepare_tier_dir(path: Path, tier: str, kind: str) -> Path:
    """Make sure `path` is a writable directory of tier `tier`; return it."""
    where = f"{kind} tier {tier!r}: path {path}"
    if not path.exists():
        if not path.parent.is_dir():
            raise TierUnavailableError(
                f"{where} does not exist and neither does its parent {path.parent}; mount the "
                "disk or create the directory, or point tiers[].path elsewhere")
        try:
            path.mkdir(mode=DIR_MODE, exist_ok=True)
        except OSError as e:
            raise _unwritable(where, e) from None
    if not path.is_dir():
        raise TierUnavailableError(f"{where} is not a directory; point tiers[].path at a "
                                   "directory")
    probe = path / f".kvtier-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        fd = None  # a leftover of a crashed probe: the directory is writable all the same
    except OSError as e:
        raise _unwritable(where, e) from None
    if fd is not None:
        os.close(fd)
    probe.unlink(missing_ok=True)
    return path


def _unwritable(where: str, e: OSError) -> TierUnavailableError:
    if e.errno == errno.EROFS:
        return TierUnavailableError(f"{where} is on a read-only filesystem; remount it "
                                    "read-write or point tiers[].path at a writable directory")
    if e.errno in (errno.EACCES, errno.EPERM):
        return TierUnavailableError(f"{where} is not writable by uid {os.getuid()}; fix its "
                                    "owner or mode, or point tiers[].path elsewhere")
    return TierUnavailableError(f"{where} cannot be written ({e.strerror}); check the disk "
                                "or point tiers[].path elsewhere")
