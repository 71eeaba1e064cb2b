"""The background mover: persistence, demotion, promotion and prefetch between tiers.

One thread per store. Work arrives on a bounded queue (`persist`, `promote`) and from a
periodic tick (watermarks, due prefetches). Persists go first: a block saved on this node
is seen by the others once it reaches the shared tier, and a small pool may drop it before
then, while a promotion only makes a block that is already safe faster to load. Every copy is read from the source tier into the
mover's own aligned arena (bounded by `mover.buffer`), written to the destination (whose put
is two-phase in the index), and only then may the source copy be dropped: a crash at any
point leaves each block in at least one tier. Lookups and loads never wait for the mover;
`make_room` is the one synchronous step, run by `save` before writing to the first tier.

A persist normally reads its blocks back from the tier they were saved to (the pool). When
that tier may drop them first (`PersistRisk`: it is full, so evicting, or a copy down has
just found a block gone), and for blocks it refused, `persist` keeps copies of the saved
frames in a `FrameHold` (bounded by `mover.buffer` too) and the copies go down from there:
the source is not read back.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Sequence

from kvtier.store import block
from kvtier.store.errors import TierError, TierFullError, TierUnavailableError
from kvtier.store.frame_hold import FrameHold, PersistRisk
from kvtier.tiers import MISS, Tier

log = logging.getLogger(__name__)
REAP_EVERY_S = 5.0
NODE_LOCAL_KINDS = frozenset({"nvme"})
TIER_COUNTERS = ("persist_misses", "demote_misses", "from_frames", "unheld")
HOLD_IDLE_S = 60.0  # unmap the hold's recycled slabs after this long without a hold


class Mover:
    """Moves blocks between the tiers of one `TieredStore`.

    With `start=False` no thread runs: queued work waits for `step()` (one round of the
    thread's loop), or `drain()` and `tick()`, which raise what a tier raises (tests, and
    lookup-only stores that never save).
    """

    def __init__(self, store, start: bool = True):
        self.store = store
        self.cfg = store.policy.mover
        # by priority: a persist never waits behind promotions (a load's whole prefix)
        self._queues: dict[str, collections.deque] = {"persist": collections.deque(),
                                                     "promote": collections.deque()}
        self._queued = 0
        self.hold = FrameHold(self.cfg.buffer_bytes)
        self.risk = PersistRisk(self.cfg.low_watermark)
        self._cv = threading.Condition()
        self._stop = False
        self._arena: memoryview | None = None
        self._io_lock = threading.Lock()  # one batch in the arena at a time
        self._full: dict[Tier, int] = {}  # tiers a copy found full -> bytes that did not fit
        self.stats = collections.Counter()
        self._thread = None
        self._last_reap = time.monotonic()
        if start:
            self._thread = threading.Thread(target=self._run, name="kvtier-mover", daemon=True)
            self._thread.start()

    # ---- requests (any thread) ----------------------------------------------------------

    def persist(self, keys: Sequence[str], src: str, hint=None,
                frames: dict[str, memoryview] | None = None, refused: Sequence[str] = ()
                ) -> None:
        """Copy `keys` from `src` to the capacity tiers that admit them (in the background).

        `frames`: sealed frames of the blocks just written to `src`, by key, valid during
        this call only. If `src` may drop them before the mover reads them back, they are
        copied into the hold and the persist writes from the copies. `refused`: keys of
        `frames` that `src` did not store (full): held and persisted whatever the risk."""
        if src == self.store.tiers[-1].name:
            return
        frames = frames or {}
        written = [k for k in keys if k in frames]
        copy = [k for k in refused if k in frames]
        keys = [*keys, *copy]
        if not keys:
            return
        if written and self.risk.at_risk(self.store.by_name[src]):
            copy += written
        held = self.hold.hold(copy, [frames[k] for k in copy]) if copy else []
        if copy:
            self.stats["held"] += len(held)
            self.stats[f"unheld_{src}"] += len(copy) - len(self.hold.frames(copy))
        if not self._enqueue("persist", keys, src, held):
            self._release(held)

    def promote(self, keys: Sequence[str], src: str) -> None:
        """Copy `keys` from `src` up to the first tier (promotion on hit, prefetch); queued
        a batch a job, so a persist waits behind one batch at most, not a whole prefix."""
        if self.cfg.promote_on_hit:
            self._enqueue_promotions(keys, src)

    def _enqueue_promotions(self, keys: Sequence[str], src: str) -> None:
        for i in range(0, len(keys), self.cfg.batch_blocks):
            self._enqueue("promote", keys[i:i + self.cfg.batch_blocks], src)

    def _enqueue(self, kind: str, keys: Sequence[str], src: str, held: Sequence[str] = ()
                 ) -> bool:
        if not keys:
            return True
        with self._cv:
            if self._queued + len(keys) > self.cfg.queue_blocks:
                # Bounded memory: a dropped persist leaves the block in the pool only.
                self.stats[f"{kind}_dropped"] += len(keys)
                return False
            self._queues[kind].append((kind, list(keys), src, list(held)))
            self._queued += len(keys)
            self._cv.notify()
        return True

    def _release(self, held: Sequence[str]) -> None:
        """Drop held copies; under the I/O lock, as no copy may be reading them then."""
        if held:
            with self._io_lock:
                self.hold.release(held)

    def pending(self) -> int:
        """Blocks queued or being moved right now."""
        with self._cv:
            return self._queued

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._next(pop=False) and not self._stop:
                    self._cv.wait(self.cfg.interval_s)
                if self._stop and not self._next(pop=False):
                    return
            self.step()

    def step(self, tick: bool = True) -> None:
        """One round of the thread: every queued job, then the periodic work (`tick`). A
        tier that fails (its master down, its disk gone) is counted and logged, never
        raised: the job it cut short is dropped (its blocks stay where they are) and the
        other jobs still run. Stores without the thread call this between requests."""
        while True:
            try:
                self.drain()
                break
            except TierError as e:
                self._error(e)
        try:
            if tick:
                self.tick()
        except TierError as e:
            self._error(e)

    def _error(self, e: TierError) -> None:
        self.stats["errors"] += 1
        log.warning("mover: %s", e)

    def drain(self) -> None:
        """Run every queued job now (the thread's loop; tests call it directly)."""
        while True:
            with self._cv:
                job = self._next(pop=True)
                if job is None:
                    return
                kind, keys, src, held = job
            try:
                for i in range(0, len(keys), self.cfg.batch_blocks):
                    batch = keys[i:i + self.cfg.batch_blocks]
                    if kind == "persist":
                        self._persist(batch, src)
                    else:
                        self._promote(batch, src)
            finally:
                self._release(held)  # copied or failed: the pool's copy is what is left
                with self._cv:
                    self._queued -= len(keys)  # counted until done, so pending() is exact

    def _next(self, pop: bool):
        """The next job by priority (taken off its queue with `pop`), or None; `_cv` held."""
        for queue in self._queues.values():
            if queue:
                return queue.popleft() if pop else queue[0]
        return None

    def tick(self) -> None:
        """Periodic work: watermarks, early demotions, due prefetches, reclaim."""
        placement = self.store.placement
        for tier in self.store.tiers:
            self._enforce_watermark(tier)
        for tier in self.store.tiers[:-1]:
            self.demote(tier, placement.demotions(tier, self.cfg.buffer_bytes))
        for src, keys in placement.prefetch_due(self.cfg.buffer_bytes).items():
            self._enqueue_promotions(keys, src)
        now = time.monotonic()
        if now - self._last_reap >= REAP_EVERY_S:
            self._last_reap = now
            self.reclaim(placement.reap())
            self.hold.trim(HOLD_IDLE_S)
            self.store.save_counters()

    def reclaim(self, keys: list[str]) -> int:
        """Drop blocks no live session references from the node-local tiers.

        Shared tiers (the pool, sharedfs) keep them: a session this node thinks ended may
        be alive on another node; their policies evict them first under pressure instead.
        """
        removed = 0
        for tier in self.store.tiers:
            if keys and tier.kind in NODE_LOCAL_KINDS:
                removed += tier.delete(keys)
                self.store.placement.on_remove(tier, keys)
        self.stats["reclaimed"] += removed
        return removed

    def stop(self) -> None:
        """Finish queued work and stop the thread."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    # ---- moves --------------------------------------------------------------------------

    def _persist(self, keys: list[str], src: str) -> None:
        tiers = self.store.tiers
        below = tiers[[t.name for t in tiers].index(src) + 1:]
        plan = {}
        for dst in below:
            admitted = self.store.placement.admit(dst, keys)
            plan[dst] = [k for k, ok in zip(keys, admitted) if ok]
        self.fan_out(self.store.by_name[src], plan, why="persist")

    def _promote(self, keys: list[str], src: str) -> None:
        first = self.store.tiers[0]
        todo = [k for k, held in zip(keys, first.contains(keys)) if not held]
        if todo:
            self.make_room(first, sum(self.store.placement.frame_bytes(k) for k in todo))
            self.copy(self.store.by_name[src], first, todo, why="promote")

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
        with self._io_lock:
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
            self.store.placement.on_insert(dst, done, [len(frames[k]) for k in done], None)
            self.stats[f"copied_{src.name}_{dst.name}"] += len(done)
            self.stats[f"from_frames_{dst.name}"] += sum(k in from_hold for k in done)
        return copied

    def _read(self, src: Tier, keys: list[str], why: str) -> dict[str, memoryview]:
        """`keys` read from `src` into the arena (the I/O lock held), by key; misses left
        out. A block gone while waiting to be copied down is lost to the tiers below."""
        if not keys:
            return {}
        outs = self._frames([self.store.placement.frame_bytes(k) for k in keys])
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
        back from the pool) and `unheld` (blocks saved to it at risk that the full hold
        could not copy)."""
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
            stored = set(getattr(e, "stored", ()))
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
            if total > self.cfg.buffer_bytes and self._arena is not None:
                raise TierError(f"a mover batch needs {total} bytes, mover.buffer is "
                                f"{self.cfg.buffer_bytes}; raise mover.buffer")
            self._arena = block.alloc_aligned(max(total, min(self.cfg.buffer_bytes, 64 << 20)))
        out, off = [], 0
        for slot in slots:
            out.append(self._arena[off:off + slot])
            off += slot
        return out

    # ---- room ---------------------------------------------------------------------------

    def make_room(self, tier: Tier, incoming: int) -> None:
        """Free space in `tier` so `incoming` bytes fit below its high watermark."""
        limit = self.cfg.high_watermark * tier.capacity_bytes
        used = tier.used_bytes()
        if used + incoming > limit:
            target = self.cfg.low_watermark * tier.capacity_bytes
            self.evict(tier, int(used + incoming - target))

    def _enforce_watermark(self, tier: Tier) -> None:
        used = tier.used_bytes()
        if used > self.cfg.high_watermark * tier.capacity_bytes:
            self.evict(tier, int(used - self.cfg.low_watermark * tier.capacity_bytes))

    def evict(self, tier: Tier, need_bytes: int) -> int:
        """Demote the policy's victims from `tier` one tier down (if admitted), then drop them."""
        return self.demote(tier, self.store.placement.victims(tier, need_bytes))

    def demote(self, tier: Tier, victims: list[str]) -> int:
        """Copy `victims` one tier down where admitted, then remove them from `tier`."""
        if not victims:
            return 0
        tiers = self.store.tiers
        pos = tiers.index(tier)
        if pos + 1 < len(tiers):
            below = tiers[pos + 1]
            admitted = self.store.placement.admit(below, victims)
            keep = [k for k, ok in zip(victims, admitted) if ok]
            if keep:
                self.copy(tier, below, keep, why="demote")
        removed = tier.delete(victims)
        self.store.placement.on_remove(tier, victims)
        self.stats[f"evicted_{tier.name}"] += removed
        return removed
