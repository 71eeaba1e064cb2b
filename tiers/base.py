"""The storage-tier contract: a dumb, batched byte store of sealed block frames.

A frame is a block as stored (`kvtier.store.base.block`): a 64-byte header naming the key and
checksumming the payload, then the payload. Tiers never interpret payloads.

Primitives (batched only; a miss is a value, never an exception):
- `contains(keys) -> list[bool]`
- `put(keys, frames) -> list[bool]`: True where the key is now stored (or already was).
- `get(keys, outs) -> list[int]`: payload length read into `outs[i]` (the whole frame lands at
  `outs[i][0:HEADER_SIZE + n]`), or `MISS`.
- `delete(keys) -> int`: how many were removed.
- `capacity_bytes`, `used_bytes()`, `usable_bytes()`, `counters()`, `close()`.
- optional: `locate(keys)` and `verify_in_place(keys, runs, checksums)`, reads without a
  copy where a tier can offer them (the pool's segment files); a caller uses only what the
  second confirms, given checksums of the bytes the caller used.

Callers guarantee:
- keys are well-formed block keys (`keys.check_key`); `frames[i]` is sealed for `keys[i]`;
- `outs[i]` is writable and at least as long as the stored frame (the namespace fixes it);
- buffers stay alive and unmodified until the call returns.

Implementations MUST:
- make each put atomic per key: a concurrent or later reader sees the whole frame or a miss,
  never a torn one, in this process and in every other process sharing the tier;
- verify every frame on read (header, key, length, checksum). A frame that fails is counted
  in `corrupt`, quarantined (deleted or moved aside, and dropped from the index) and reported
  as `MISS`: bad bytes are never returned;
- on a full tier, make room by their own reclaim where the contract of the tier allows it
  (nvme reclaims whole regions); where nothing can be freed (disk full, pool full with
  nothing evictable) raise `TierFullError` with `.stored` naming the keys of the batch that
  were stored before it, leaving no torn block, and keep serving reads;
- raise `TierUnavailableError` when the backend cannot be reached, and recover by themselves
  when it returns (no process restart);
- be safe for concurrent calls from several threads.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Sequence

from kvtier.store.base.block import HEADER_SIZE
from kvtier.store.base.config import MasterConfig
from kvtier.store.base.errors import TierFullError
from kvtier.store.base.index import Index

MISS = -1


@dataclass(frozen=True)
class TierContext:
    """What a tier needs besides its own config: the node's index and identity.

    `recover`: run crash recovery at open (drop dead writers' PENDING entries, adopt their
    regions, sweep stale temp files). `kvtier inspect check` opens tiers with False, so the
    leftovers are still there to be reported (and repaired only with `--fix`).
    `lend`: this process lends pool memory (its Mooncake segment); a process that only asks
    what the pool holds (vLLM's scheduler, its workers elsewhere) lends none.
    """

    index: Index
    node_id: str
    master: MasterConfig
    recover: bool = True
    lend: bool = True


@dataclass
class TierCounters:
    """Monotonic counters of one tier in this process."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    puts: int = 0
    deletes: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    in_place: int = 0  # of `hits`, those read where they lie (`locate`), without a copy
    late: int = 0      # blocks a load gave up on at its deadline (the store counts them)
    cross_host_hits: int = 0  # of `hits`, those from a lender on another host (when counted)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def add_reads(self, results: Sequence[int], **more: int) -> None:
        """Count one batched read: `results` are payload lengths or `MISS`, per key; every
        hit moved its frame out (header and payload); `more` adds other counters."""
        hits = [n for n in results if n != MISS]
        self.add(hits=len(hits), misses=len(results) - len(hits),
                 bytes_out=sum(hits) + HEADER_SIZE * len(hits), **more)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            # not asdict(): it deep-copies every field, and a lock cannot be copied
            return {f.name: getattr(self, f.name) for f in fields(self)
                    if not f.name.startswith("_")}


@dataclass(frozen=True)
class InPlaceRun:
    """Blocks `first .. first + count - 1` of a read, lying in one segment mapping at one
    stride: the frame of block `first + j` is `mem[offset + j * stride:][:size]`."""

    first: int
    count: int
    mem: memoryview
    offset: int
    stride: int
    size: int


# Kinds a check reports and a fix clears, which still leave the check clean.
NOTICE_KINDS = frozenset({"gone"})


@dataclass(frozen=True)
class Problem:
    """One inconsistency `check` found between the index, the tier's bytes and checksums.

    kinds: `missing` (index entry, no bytes), `orphan` (bytes or files no entry explains),
    `size` / `checksum` (entry and stored frame disagree), `corrupt` (frame fails
    verification), `pending` (a dead writer's PENDING entry), `stale_temp` (a temp file left
    by a dead writer), `region` (nvme: the region table and an entry disagree on what lies
    where), `stats` (a tier's usage counters disagree with its entries), `gone` (a shared
    tier: this node's entry, and nothing at all at its path: another node evicted the file,
    or it was lost. Either way a read is a plain miss and forgets the entry, so it is a
    notice, not a problem: it leaves a check clean, and `fix` drops the entry).
    """

    kind: str
    tier: str
    key: str | None = None
    path: str | None = None
    detail: str = ""


class Tier(ABC):
    """One storage tier. Subclasses hold one backend; see the module docstring."""

    kind: str = ""
    # The backend evicts by itself, in an order that sees every process's reads (the pool's
    # master, by lease): a process's policy sees only its own. Where nothing lies below
    # such a tier to demote to, the store leaves the evicting to the backend.
    evicts_by_all_reads: bool = False

    def __init__(self, name: str, capacity_bytes: int):
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.stats = TierCounters()

    @abstractmethod
    def contains(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def put(self, keys: Sequence[str], frames: Sequence[memoryview]) -> list[bool]: ...

    @abstractmethod
    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int]: ...

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> int: ...

    @abstractmethod
    def used_bytes(self) -> int: ...

    def usable_bytes(self) -> int:
        """What the tier can hold before its backend refuses writes or evicts on its own:
        `capacity_bytes`, unless the backend has shown less (`MooncakeTier`). The mover's
        watermarks are fractions of this."""
        return self.capacity_bytes

    def own_share(self, used: int) -> float:
        """The fraction of `used` (a `used_bytes` reading) this process's own blocks make
        up: what its eviction can free. 1.0 for a tier this process alone fills; less for
        space shared with other processes that each evict their own (a node's pool
        service)."""
        return 1.0

    def counters(self) -> dict[str, int]:
        return self.stats.snapshot()

    def lender_failures(self) -> dict[str, int]:
        """Blocks whose read failed or came late, by the lender that held them (the pool's
        transport endpoint), since this tier opened; none for a tier with no lenders."""
        return {}

    def blame_late(self, keys: Sequence[str]) -> None:
        """Count `keys`, given up on by a deadline, against the lenders that hold them."""

    def locate(self, keys: Sequence[str]) -> list[InPlaceRun]:
        """Runs of `keys` the caller may read where they lie, without a copy (see
        `MooncakeTier.locate`); none by default. Bytes read so are unverified: the caller
        must call `verify_in_place` with checksums of what it used, and use only what that
        confirms."""
        return []

    def verify_in_place(self, keys: Sequence[str], runs: Sequence[InPlaceRun],
                        checksums: Sequence) -> list[int]:
        """Payload length per key of what the caller read from `runs`, whose payloads it
        checksummed where it used them (`checksums`, see `MooncakeTier`), or `MISS`."""
        return [MISS] * len(keys)

    def check(self, progress=None) -> list[Problem]:
        """Compare the index with the tier's bytes and checksums; change nothing.

        `progress(done, total)` is called now and then on long scans. Tiers whose contents
        the node cannot enumerate (the pool) check what the index records of them.
        """
        return []

    def repair(self, problems: Sequence[Problem]) -> int:
        """Remove what `check` found untrustworthy (entries and bytes); return how many."""
        return 0

    def close(self) -> None:
        """Release the backend; further calls are errors. Idempotent."""

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def full_error(tier: str, reason: str, fix: str, stored: Sequence[str]) -> TierFullError:
    """A TierFullError whose `.stored` lists the keys the batch stored before it filled up."""
    return TierFullError(f"tier {tier!r} is full ({reason}); {fix}", stored)
