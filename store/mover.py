"""The background mover: persistence, demotion, promotion and prefetch between tiers.

One thread per store. Work arrives on a bounded queue (`persist`, `promote`) and from a
periodic tick (watermarks, due prefetches). While the engine computes a prefill
(`engine_busy`), a queued job waits until the prefill ends or it has been queued for
`mover.yield_to_prefill_s`: on a host whose CPUs the prefill uses (a CPU engine, a busy
host) every copy the mover makes between a prompt's chunks delays its first token, and a
job that has waited that long runs whatever the engine does, so a steady stream of
prefills delays persists by at most that much. A persist also waits, as long, while the
engine decodes (`engine_stepped`: until no step has ended for `mover.idle_after_s`): its
writes, a shared directory's most (a dozen system calls a file, each giving the GIL back
and taking it again), slowed the steps running beside them by up to 1.7x, and an agent's
turns leave gaps to write in. It never waits while the tier it copies from may drop the
blocks first (`PersistRisk`) or its queue is half full.

Persists go first: a block saved on this node is seen by the others once it reaches the
shared tier, and a small pool may drop it before then, while a promotion only makes a
block that is already safe faster to load. Every copy
goes through the `Copier` (`store.copier`): read from the source tier into one aligned arena
(bounded by `mover.buffer`), written to the destination (whose put is two-phase in the
index), and only then may the source copy be dropped: a crash at any point leaves each
block in at least one tier. Lookups and loads never wait for the mover;
`make_room` is the one synchronous step, run by `save` before writing to the first tier.

A persist normally reads its blocks back from the tier they were saved to (the pool). When
that tier may drop them first (`PersistRisk`: it is full, so evicting, or a copy down has
just found a block gone), and for blocks it refused, `persist` keeps copies of the saved
frames in a `FrameHold` (bounded by `mover.buffer` too) and the copies go down from there:
the source is not read back. A block evicted before its persist came to it goes down with
its demotion to this node's nvme and to the shared tier both (`demote`): other nodes look
in the shared tier only. One whose demotion could not reach the shared tier (it did not
answer) is taken by its persist from the tier it was demoted to.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Sequence

from kvtier.store.base.config import MoverConfig
from kvtier.store.base.errors import TierError
from kvtier.store.base.index import Index
from kvtier.store.base.repeats import thin
from kvtier.store.copier import Copier
from kvtier.store.counters import write_counters
from kvtier.store.frame_hold import FrameHold, PersistRisk
from kvtier.store.rates import LoadRates
from kvtier.tiers.base import Tier

if TYPE_CHECKING:
    from kvtier.store.placement import Placement

log = thin(logging.getLogger(__name__))  # a tier away: one line per message per 10 s
REAP_EVERY_S = 5.0
ROWS_EVERY_S = 1.0  # how stale `inspect sessions` may show a session's blocks per tier
NODE_LOCAL_KINDS = frozenset({"nvme"})
HOLD_IDLE_S = 60.0  # unmap the hold's recycled slabs after this long without a hold


class Mover:
    """Moves blocks between the tiers of one `TieredStore`.

    With `start=False` no thread runs: queued work waits for `step()` (one round of the
    thread's loop), or `drain()` and `tick()`, which raise what a tier raises (tests, and
    lookup-only stores that never save).
    """

    def __init__(self, tiers: Sequence[Tier], placement: "Placement", index: Index,
                 node_id: str, cfg: MoverConfig, start: bool = True,
                 rates: LoadRates | None = None):
        self.tiers = list(tiers)
        self.rates = rates  # published with the counters (`store.counters`)
        self.by_name = {t.name: t for t in self.tiers}
        self.placement, self.index, self.node_id = placement, index, node_id
        self.cfg = cfg
        # by priority: a persist never waits behind promotions (a load's whole prefix)
        self._queues: dict[str, collections.deque] = {"persist": collections.deque(),
                                                     "promote": collections.deque()}
        self._queued = 0
        self.hold = FrameHold(self.cfg.buffer_bytes if self.cfg.hold_bytes is None
                              else self.cfg.hold_bytes)
        self.risk = PersistRisk(self.cfg.low_watermark)
        self._cv = threading.Condition()
        self._stop = False
        self._busy = False  # the engine is computing a prefill
        self._last_step = -float("inf")  # when the engine's latest step ended
        self.stats = collections.Counter()
        self.copier = Copier(placement, self.cfg.buffer_bytes, self.hold, self.risk, self.evict,
                             self.stats)
        self._thread = None
        self._last_reap = self._last_rows = time.monotonic()
        if start:
            self.start()

    def start(self) -> None:
        """Start the thread (once; a store opened lookup-only can gain a mover later)."""
        with self._cv:
            if self._thread is None and not self._stop:
                self._thread = threading.Thread(target=self._run, name="kvtier-mover",
                                                daemon=True)
                self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def usage(self) -> dict[str, dict[str, int]]:
        """Capacity, used bytes and counters of every tier (this mover's among them)."""
        out = {t.name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes(),
                        **t.counters(), **self.copier.tier_counters(t.name)}
               for t in self.tiers}
        for t in self.tiers:
            if lenders := t.lender_failures():
                out[t.name]["lenders"] = lenders
        return out

    def save_counters(self) -> None:
        """Record this process's tier counters in the index (for `kvtier inspect`)."""
        write_counters(self.index, self.node_id, self.usage(),
                       self.rates.rows() if self.rates is not None else None,
                       self.placement.selection())

    # ---- requests (any thread) ----------------------------------------------------------

    def persist(self, keys: Sequence[str], src: str, hint=None,
                frames: dict[str, memoryview] | None = None, refused: Sequence[str] = ()
                ) -> None:
        """Copy `keys` from `src` to the capacity tiers that admit them (in the background).

        `frames`: sealed frames of the blocks just written to `src`, by key, valid during
        this call only. If `src` may drop them before the mover reads them back, they are
        copied into the hold and the persist writes from the copies. `refused`: keys of
        `frames` that `src` did not store (full): held and persisted whatever the risk."""
        if src == self.tiers[-1].name:
            return
        frames = frames or {}
        written = [k for k in keys if k in frames]
        copy = [k for k in refused if k in frames]
        keys = [*keys, *copy]
        if not keys:
            return
        if written and self.risk.at_risk(self.by_name[src]):
            copy += written
        held = self.hold.hold(copy, [frames[k] for k in copy]) if copy else []
        if copy:
            self.stats["held"] += len(held)
            self.stats[f"unheld_{src}"] += len(copy) - len(self.hold.frames(copy))
        if not self._enqueue("persist", keys, src, held):
            self.copier.release(held)

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
            self._queues[kind].append((kind, list(keys), src, list(held), time.monotonic()))
            self._queued += len(keys)
            self._cv.notify()
        return True

    def engine_busy(self, busy: bool) -> None:
        """The engine started (True) or finished (False) computing a prefill."""
        if self._busy == busy:  # told every step; only a change needs the lock
            return
        with self._cv:
            if self._busy != busy:
                self._busy = busy
                if not busy:
                    self._cv.notify_all()

    def engine_stepped(self) -> None:
        """The engine ended a step (of any kind): persists wait until it has been idle for
        `idle_after_s`."""
        self._last_step = time.monotonic()  # one float: read without the lock

    def _stepping(self, now: float) -> float:
        """Seconds until the engine counts as idle (0 if it does)."""
        return max(0.0, self._last_step + self.cfg.idle_after_s - now)

    def _yield(self, queued_at: float, src: str, kind: str = "persist") -> None:
        """Wait while the engine computes a prefill, and a persist also while the engine
        steps (decodes), until the job has been queued for `yield_to_prefill_s`; never
        while `src` may drop what the job copies from it or the queue is half full.
        (Promotions and prefetches wait only for a prefill: a session due back needs its
        blocks in time.)"""
        limit = queued_at + self.cfg.yield_to_prefill_s
        decoding = kind == "persist"
        if ((not self._busy and not (decoding and self._stepping(time.monotonic())))
                or self.risk.at_risk(self.by_name[src])):
            return  # the risk asks the tier for its usage: only when there is a wait to skip
        with self._cv:
            while not self._stop and self._queued <= self.cfg.queue_blocks // 2:
                now = time.monotonic()
                left = limit - now
                stepping = self._stepping(now) if decoding else 0.0
                if left <= 0 or not (self._busy or stepping):
                    return
                self.stats["yield_waits"] += 1
                # a prefill's end notifies; a decode's end is seen when its idle time is up
                self._cv.wait(left if self._busy else min(left, stepping))

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
                kind, keys, src, held, queued_at = job
            try:
                for i in range(0, len(keys), self.cfg.batch_blocks):
                    if self._thread is not None:  # tests and thread-less stores never wait
                        self._yield(queued_at, src, kind)
                    batch = keys[i:i + self.cfg.batch_blocks]
                    if kind == "persist":
                        self._persist(batch, src)
                    else:
                        self._promote(batch, src)
            finally:
                self.copier.release(held)  # copied or failed: the pool's copy is what is left
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
        placement = self.placement
        for tier in self.tiers:
            self._enforce_watermark(tier)
        for tier in self.tiers[:-1]:
            self.demote(tier, placement.demotions(tier, self.cfg.buffer_bytes))
        for src, keys in placement.prefetch_due(self.cfg.buffer_bytes).items():
            self._enqueue_promotions(keys, src)
        now = time.monotonic()
        if now - self._last_rows >= ROWS_EVERY_S:
            self._last_rows = now
            placement.refresh_rows()
        if now - self._last_reap >= REAP_EVERY_S:
            self._last_reap = now
            self.reclaim(placement.reap())
            self.hold.trim(HOLD_IDLE_S)
            self.save_counters()

    def reclaim(self, keys: list[str]) -> int:
        """Drop blocks no live session references from the node-local tiers.

        Shared tiers (the pool, sharedfs) keep them: a session this node thinks ended may
        be alive on another node; their policies evict them first under pressure instead.
        """
        removed = 0
        for tier in self.tiers:
            if keys and tier.kind in NODE_LOCAL_KINDS:
                removed += tier.delete(keys)
                self.placement.on_remove(tier, keys)
        self.stats["reclaimed"] += removed
        return removed

    def stop(self) -> None:
        """Finish the queued persists and stop the thread. Queued promotions are dropped:
        they would lift blocks into a store about to close, and their source keeps its
        copy, so the stop is shorter (vLLM kills a worker that takes too long) and loses
        nothing."""
        with self._cv:
            self._stop = True
            promotions = list(self._queues["promote"])
            self._queues["promote"].clear()
            dropped = sum(len(job[1]) for job in promotions)
            self._queued -= dropped
            self.stats["promote_dropped_at_stop"] += dropped
            self._cv.notify_all()
        for _, _, _, held, _ in promotions:
            self.copier.release(held)
        if self._thread is not None:
            self._thread.join()

    # ---- moves --------------------------------------------------------------------------

    def _persist(self, keys: list[str], src: str) -> None:
        tiers = self.tiers
        below = tiers[[t.name for t in tiers].index(src) + 1:]
        plan = {dst: self._admitted(dst, keys) for dst in below}
        source = self.by_name[src]
        copied = self.copier.fan_out(source, plan, why="persist")
        # A block `src` dropped before this job came to it (a save beside it made room, and
        # its demotion did not reach every tier below) goes on from the first tier below that
        # holds it, so the ones further down, the shared one where other nodes look, get it.
        # Only blocks gone from `src`: one a destination refused is not tried twice.
        left = {dst: set(plan[dst]) - set(copied.get(dst.name, ())) for dst in below[1:]}
        wanted = [k for k in keys if any(k in ks for ks in left.values())]
        if not wanted:
            return
        gone = [k for k, has in zip(wanted, source.contains(wanted)) if not has]
        for i, via in enumerate(below[:-1]):
            if not gone:
                return
            there = {k for k, has in zip(gone, via.contains(gone)) if has}
            if there:
                self.copier.fan_out(via, {dst: [k for k in plan[dst]
                                                if k in there and k in left[dst]]
                                          for dst in below[i + 1:]}, why="persist")
            gone = [k for k in gone if k not in there]

    def _promote(self, keys: list[str], src: str) -> None:
        first = self.tiers[0]
        todo = [k for k, held in zip(keys, first.contains(keys)) if not held]
        if not todo:
            return
        try:
            self.make_room(first, sum(self.placement.frame_bytes(k) for k in todo))
            self.copier.copy(self.by_name[src], first, todo, why="promote")
        finally:
            # Landed blocks were unmarked as they went in; the others may be offered again.
            # Blocks another node had already lifted stay marked until the give-up time, so
            # they are not asked about every tick.
            self.placement.prefetch_settled(todo)

    # ---- room ---------------------------------------------------------------------------

    def make_room(self, tier: Tier, incoming: int) -> None:
        """Free space in `tier` so `incoming` bytes fit below its high watermark."""
        if not self._evicts(tier):
            return
        limit = self.cfg.high_watermark * tier.usable_bytes()
        used = tier.used_bytes()
        if used + incoming > limit:
            self.evict(tier, self._share_over(tier, used) + incoming)

    def _enforce_watermark(self, tier: Tier) -> None:
        if not self._evicts(tier):
            self._forget_overflow(tier)
            return
        used = tier.used_bytes()
        if used > self.cfg.high_watermark * tier.usable_bytes():
            self.evict(tier, self._share_over(tier, used))

    def _evicts(self, tier: Tier) -> bool:
        """Whether this store evicts from `tier`. Not from the last tier when its backend
        evicts by every process's reads (a pool with nothing below it): a victim has
        nowhere to go, and this process ranks only the blocks it put by its own reads of
        them (measured on the main job at 25%: 56.5% hit, 60.6 with the master's order)."""
        return not (tier.evicts_by_all_reads and tier is self.tiers[-1])

    def _forget_overflow(self, tier: Tier) -> None:
        """A tier this store does not evict drops blocks without telling it: what its policy
        tracks beyond the tier's capacity it forgets, lowest ranked first (the blocks the
        backend most likely dropped), so the policy's state stays bounded. Nothing is
        deleted."""
        over = self.placement.tracked_bytes(tier) - tier.capacity_bytes
        if over > 0:
            self.placement.on_remove(tier, self.placement.victims(tier, over))

    def _share_over(self, tier: Tier, used: int) -> int:
        """This process's part of what `tier` holds above its low watermark. Processes that
        fill one space (a node's pool service) each see all of it used; each freeing the
        whole excess freed it once per process and left the pool half empty."""
        over = max(0.0, used - self.cfg.low_watermark * tier.usable_bytes())
        return int(over * tier.own_share(used))

    def evict(self, tier: Tier, need_bytes: int) -> int:
        """Demote the policy's victims from `tier` one tier down (if admitted), then drop them."""
        return self.demote(tier, self.placement.victims(tier, need_bytes))

    def demote(self, tier: Tier, victims: list[str]) -> int:
        """Copy `victims` one tier down where admitted, then remove them from `tier`.

        Where one tier down is this node's own (nvme), a victim that no tier other nodes
        read holds yet (its persist is still queued: the mover lags the saves) also goes to
        the first such tier below: a router sends a session's next turn to any node, and a
        block left in this node's nvme alone would be a miss there, cutting the rest of the
        session's prefix with it."""
        if not victims:
            return 0
        below = self.tiers[self.tiers.index(tier) + 1:]
        if below:
            plan = {below[0]: self._admitted(below[0], victims)}
            # the first tier other nodes read, when it is not the one a demotion goes to
            seen = next((t for t in below[1:] if t.kind not in NODE_LOCAL_KINDS), None)
            if below[0].kind not in NODE_LOCAL_KINDS:
                seen = None
            if seen is not None:
                # this process's view first: a stat per victim only for what it did not copy
                unseen = [k for k, has in zip(victims, self.placement.holds(seen, victims))
                          if not has]
                plan[seen] = self._admitted(seen, unseen)
            copied = self.copier.fan_out(tier, plan, why="demote")
            if seen is not None:
                self.stats[f"demote_unpersisted_{seen.name}"] += len(copied.get(seen.name, ()))
        removed = tier.delete(victims)
        self.placement.on_remove(tier, victims)
        self.stats[f"evicted_{tier.name}"] += removed
        return removed

    def _admitted(self, tier: Tier, keys: list[str]) -> list[str]:
        return [k for k, ok in zip(keys, self.placement.admit(tier, keys)) if ok] if keys else []
