"""The mover's byte path: copies of blocks between tiers through one aligned arena.

Every copy reads its blocks from the source tier into the arena (page-aligned frames, bounded
by `mover.buffer`), or takes the copies the `FrameHold` keeps of saved frames, then writes
them to each destination tier (two-phase in the index there). One batch uses the arena at a
time (`io_lock`). A destination found full is only noted while the arena is held; room is
made (`evict`, which copies through the arena itself) once it is free. The source copy is
never touched here: dropping it is the caller's step, after the copy.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, Sequence

from kvtier.store.base import block
from kvtier.store.base.errors import TierError, TierFullError, TierUnavailableError
from kvtier.store.base.repeats import thin
from kvtier.store.frame_hold import FrameHold, PersistRisk
from kvtier.tiers.base import MISS, Tier

log = thin(logging.getLogger(__name__))  # a tier away: one line per message per 10 s
TIER_COUNTERS = ("persist_misses", "demote_misses", "from_frames", "unheld",
                 "demote_unpersisted")


class Copier:
    """Copies blocks between the tiers of one store (`placement` hears of every copy).
    `evict(tier, bytes)` makes room in a tier found full; `stats` is the mover's counter,
    shared."""

    def __init__(self, placement, buffer_bytes: int, hold: FrameHold, risk: PersistRisk,
                 evict: Callable[[Tier, int], int], stats: collections.Counter):
        self.placement = placement
        self.buffer_bytes = buffer_bytes
        self.hold, self.risk, self.evict, self.stats = hold, risk, evict, stats
        self.io_lock = threading.Lock()  # one batch in the arena at a time
        self._arena: memoryview | None = None
        self._full: dict[Tier, int] = {}  # tiers a copy found full -> bytes that did not fit

    def release(self, held: Sequence[str]) -> None:
        """Drop held copies; under the I/O lock, as no copy may be reading them then."""
        if held:
            with self.io_lock:
                self.hold.release(held)

    def copy(self, src: Tier, dst: Tier, keys: list[str], why: str = "copy") -> list[str]:
        """Copy `keys` from `src` to `dst` (skipping those `dst` holds); return those copied."""
        return self.fan_out(src, {dst: keys}, why).get(dst.name, [])

    def fan_out(self, src: Tier, plan: dict[Tier, list[str]], why: str = "copy"
                ) -> dict[str, list[str]]:
        """Read each block of `plan` from `src` once (or take its held copy) and write it to
        every tier that wants it and does not hold it yet; return the keys copied, by
        destination tier name. `why` names the read misses in the stats (`{why}_misses`)."""
        plan = {dst: [k for k, held in zip(keys, dst.contains(keys)) if not held]
                for dst, keys in plan.items() if keys}
        wanted = list(dict.fromkeys(k for keys in plan.values() for k in keys))
        if not wanted:
            return {}
        copied: dict[str, list[str]] = {}
        with self.io_lock:
            frames = self.hold.frames(wanted)
            from_hold = set(frames)
            frames.update(self._read(src, [k for k in wanted if k not in from_hold], why))
            for dst, keys in plan.items():
                ready = [k for k in keys if k in frames]
                if ready:
                    copied[dst.name] = self._put(src, dst, ready, [frames[k] for k in ready])
        for dst, need in self._pop_full().items():
            self.evict(dst, need)  # room for the next copies (this batch stays in `src`)
        for dst in plan:
            done = copied.get(dst.name, [])
            self.placement.on_insert(dst, done, [len(frames[k]) for k in done], None)
            self.stats[f"copied_{src.name}_{dst.name}"] += len(done)
            self.stats[f"from_frames_{dst.name}"] += sum(k in from_hold for k in done)
        return copied

    def _read(self, src: Tier, keys: list[str], why: str) -> dict[str, memoryview]:
        """`keys` read from `src` into the arena (the I/O lock held), by key; misses left
        out (a persist takes a block gone from `src` from the tier it was demoted to)."""
        if not keys:
            return {}
        outs = self._frames([self.placement.frame_bytes(k) for k in keys])
        got = src.get(keys, outs)
        missed = got.count(MISS)
        if missed:
            self.stats[f"{why}_misses_{src.name}"] += missed
            if why in ("persist", "demote"):
                self.risk.missed()
        return {k: out[:block.HEADER_SIZE + n] for k, out, n in zip(keys, outs, got)
                if n != MISS}

    def tier_counters(self, name: str) -> dict[str, int]:
        """The mover's counters of tier `name`: `persist_misses` and `demote_misses` (blocks
        gone from it when the mover came to copy them down, after a save or to evict them),
        `from_frames` (blocks written to it from held copies of saved frames, not read
        back from the pool), `unheld` (blocks saved to it at risk that the full hold
        could not copy) and `demote_unpersisted` (blocks an eviction above wrote to it, a
        tier other nodes read, before their persist had: the mover lagging the saves)."""
        return {k: self.stats[f"{k}_{name}"] for k in TIER_COUNTERS}

    def _put(self, src: Tier, dst: Tier, keys: list[str], frames: list[memoryview]
             ) -> list[str]:
        """One copy's put, with the arena held: a full tier is only noted here, and made room
        in by `fan_out` once the arena is free (eviction copies through the arena too)."""
        try:
            ok, err = self._try_put(dst, keys, frames)
        except TierUnavailableError as e:
            ok, err = [False] * len(keys), e
        if err is not None:
            self.stats["copy_errors"] += 1
            log.warning("mover copy %s -> %s: %s", src.name, dst.name, err)
        if isinstance(err, TierFullError):
            self._full[dst] = self._full.get(dst, 0) + sum(
                len(f) for f, good in zip(frames, ok) if not good)
        return [k for k, good in zip(keys, ok) if good]

    def put(self, dst: Tier, keys: Sequence[str], frames: Sequence[memoryview]) -> list[bool]:
        """`dst.put` that survives a full tier: on TierFullError (a disk fuller than the
        tier's capacity says, a pool with nothing evictable) evict what did not fit by the
        tier's policy and try that once more. TierUnavailableError propagates; other tier
        errors are logged and count as not stored. Not for use with the arena held."""
        ok, err = self._try_put(dst, keys, frames)
        if err is not None:
            log.warning("put to %s incomplete: %s", dst.name, err)
        rest = [i for i, good in enumerate(ok) if not good]
        if isinstance(err, TierFullError) and rest:
            self.stats[f"full_{dst.name}"] += 1
            self.evict(dst, sum(len(frames[i]) for i in rest))
            again, err = self._try_put(dst, [keys[i] for i in rest], [frames[i] for i in rest])
            for i, good in zip(rest, again):
                ok[i] = good
        return ok

    @staticmethod
    def _try_put(dst: Tier, keys: Sequence[str], frames: Sequence[memoryview]
                 ) -> tuple[list[bool], TierError | None]:
        try:
            return dst.put(keys, frames), None
        except TierUnavailableError:
            raise
        except TierError as e:
            stored = set(e.stored) if isinstance(e, TierFullError) else set()
            return [k in stored for k in keys], e

    def _pop_full(self) -> dict[Tier, int]:
        full, self._full = self._full, {}
        return full

    def _frames(self, sizes: list[int]) -> list[memoryview]:
        """Slices of the arena, page-aligned, for one batch (within the buffer budget)."""
        slots = [block.frame_size(s - block.HEADER_SIZE, block.PAGE) if s > block.HEADER_SIZE
                 else block.PAGE for s in sizes]
        total = sum(slots)
        if self._arena is None or len(self._arena) < total:
            if total > self.buffer_bytes and self._arena is not None:
                raise TierError(f"a mover batch needs {total} bytes, mover.buffer is "
                                f"{self.buffer_bytes}; raise mover.buffer")
            self._arena = block.alloc_aligned(max(total, min(self.buffer_bytes, 64 << 20)))
        out, off = [], 0
        for slot in slots:
            out.append(self._arena[off:off + slot])
            off += slot
        return out
