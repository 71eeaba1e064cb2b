"""The rows of the nvme tier's region table (see `tiers.nvme.regions`): records and encodings.

A region record is fixed binary (no pickle); row keys are big endian so an LMDB cursor walks
slots, seal sequence numbers and block offsets in order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from kvtier.store.base.index_record import owner_alive

OPEN, SEALED, RETIRED = 1, 2, 3
_REC = struct.Struct("<BxxxIdIxxxxQQ")  # state, pid, opened_at, gen, write offset, seal seq
SLOT = struct.Struct(">I")
SEQ = struct.Struct(">Q")
BLK = struct.Struct(">IIQ")  # slot, gen, offset (big endian: cursor order = region order)


@dataclass
class Region:
    slot: int
    state: int = OPEN
    pid: int = 0
    opened_at: float = 0.0
    gen: int = 1
    off: int = 0
    seq: int = 0

    def encode(self) -> bytes:
        return _REC.pack(self.state, self.pid, self.opened_at, self.gen, self.off, self.seq)

    @classmethod
    def decode(cls, slot: int, raw: bytes) -> "Region":
        return cls(slot, *_REC.unpack(raw))


@dataclass
class Allocation:
    """Where each frame of a batch goes, and which old generations were reclaimed for it."""

    locs: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, gen, offset)
    reclaimed: list[tuple[int, int]] = field(default_factory=list)  # (slot, old gen)


def orphaned(r: Region) -> bool:
    """An open region whose writer process is gone."""
    return r.state == OPEN and r.pid != 0 and not owner_alive(r.pid, r.opened_at)


def pack_loc(slot: int, gen: int) -> int:
    return gen << 32 | slot


def unpack_loc(loc_a: int) -> tuple[int, int]:
    return loc_a & 0xFFFFFFFF, loc_a >> 32
