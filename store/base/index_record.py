"""The fixed binary record of one index entry (no pickle, no JSON on the hot path)."""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import psutil

PENDING = 1
READY = 2
STATE_NAMES = {PENDING: "PENDING", READY: "READY"}

# state, flags, owner pid, size, checksum, loc_a, loc_b, created, last access, session length
_REC = struct.Struct("<BBxxIQQQQddH")


@dataclass(frozen=True)
class Entry:
    """One copy of one block in one tier."""

    key: str
    tier: str
    size: int = 0
    checksum: int = 0
    loc_a: int = 0  # tier-defined: nvme region id
    loc_b: int = 0  # tier-defined: nvme byte offset in the region
    session: str = ""
    state: int = PENDING
    flags: int = 0
    owner_pid: int = 0
    created: float = 0.0
    last_access: float = 0.0

    def replace(self, **changes) -> "Entry":
        return dataclasses.replace(self, **changes)

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, f"?{self.state}")


def encode_entry(e: Entry) -> bytes:
    session = e.session.encode()[:1024]
    return _REC.pack(e.state, e.flags, e.owner_pid, e.size, e.checksum, e.loc_a, e.loc_b,
                     e.created, e.last_access, len(session)) + session


def decode_entry(raw: bytes, key: str = "", tier: str = "") -> Entry:
    state, flags, pid, size, checksum, a, b, created, last, slen = _REC.unpack_from(raw)
    session = bytes(raw[_REC.size:_REC.size + slen]).decode(errors="replace")
    return Entry(key, tier, size, checksum, a, b, session, state, flags, pid, created, last)


def owner_alive(pid: int, reserved_at: float) -> bool:
    """True if process `pid` exists and started before the reservation (not a reused pid)."""
    if pid <= 0:
        return False
    try:
        started = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return False
    # create_time is rounded; allow a second of slack before calling the pid reused.
    return started <= reserved_at + 1.0
