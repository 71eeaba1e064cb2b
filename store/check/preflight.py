"""What would stop a policy's store from opening on this machine, found before it starts.

`preflight(policy)` looks at every path the policy names, as a store opening there would use
it, and changes nothing but a probe file it creates and removes at once (the one way to know
a directory is writable: `access()` says yes to root on a read-only bind mount's files):
- the index directory, each file tier's `path` and a mooncake tier's `segment_dir` must be a
  directory (or missing under an existing parent directory, which the store creates) that
  this user can write;
- a path that is a regular file, a symlink's dangling target, or under a missing parent is
  an error naming the field;
- free space below a tier's `capacity` is a warning (the nvme data file is sparse and the
  shared filesystem is shared: it may still fit), below a segment file's size an error (a
  `segment_dir` file is allocated whole at start).
Lines start with the field (`tiers[1].path`); warnings with `warning:`.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from kvtier.store.base.config import Policy
from kvtier.store.base.units import format_size


def preflight(policy: Policy) -> list[str]:
    """Problems of the policy's paths here, one line each (see the module docstring)."""
    out = _directory("index.path", Path(policy.index.path), None)
    for i, tier in enumerate(policy.tiers):
        path = getattr(tier, "path", None)
        if path is not None:
            out += _directory(f"tiers[{i}].path", Path(path), tier.capacity_bytes,
                              full_is_error=False)
        seg = getattr(tier, "segment_dir", None)
        if seg:
            out += _directory(f"tiers[{i}].segment_dir", Path(seg), tier.capacity_bytes,
                              full_is_error=True)
    return out


def _directory(field: str, path: Path, capacity: int | None,
               full_is_error: bool = False) -> list[str]:
    where = f"{field}: {path}"
    if path.is_symlink() and not path.exists():
        return [f"{where} is a symlink to nothing; point {field} at a directory"]
    if path.exists() and not path.is_dir():
        return [f"{where} is a file, not a directory; point {field} at a directory"]
    if not path.exists():
        if not path.parent.is_dir():
            return [f"{where} does not exist and neither does its parent {path.parent}; mount "
                    f"the disk or create the directory, or point {field} elsewhere"]
        probe_dir = path.parent
    else:
        probe_dir = path
    problem = _unwritable(probe_dir)
    if problem:
        return [f"{where}: {problem}; fix it or point {field} elsewhere"]
    if capacity is None:
        return []
    free = shutil.disk_usage(probe_dir).free
    if free >= capacity:
        return []
    line = (f"{where} has {format_size(free)} free, less than the tier's capacity "
            f"{format_size(capacity)}; free space or lower the capacity")
    return [line if full_is_error else f"warning: {line}"]


def _unwritable(directory: Path) -> str | None:
    """Why this user cannot create a file in `directory`, or None."""
    probe = directory / f".kvtier-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return None
    except OSError as e:
        if e.errno == errno.EROFS:
            return "it is on a read-only filesystem"
        if e.errno in (errno.EACCES, errno.EPERM):
            return f"it is not writable by uid {os.getuid()}"
        return f"it cannot be written ({e.strerror})"
    os.close(fd)
    probe.unlink(missing_ok=True)
    return None
