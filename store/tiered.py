"""`TieredStore`: the policy's tiers composed fastest first, with sessions and policies.

Primitives (batched; a miss is a value):
- `lookup(keys, hint) -> LookupResult`: the longest prefix of `keys` held by any tier, and the
  tier that holds each block (one master query; the tiers below the pool asked in growing
  windows, only up to the first key none holds). `where(keys)`: the tier of each key on
  its own (every tier asked about every key it needs).
- `load(keys, outs) -> list[int]`: each block from the fastest tier that holds it, verified;
  payload length or `MISS`. A hit below the first tier may schedule a promotion.
- `locate(keys, where)` then `confirm(keys, runs, checksums)`: blocks of the first tier the
  caller may read where they lie (another process's pool segment mapped from its file), then
  check by the checksums of what it used; only what `confirm` returns may be used (the rest
  goes through `load`).
- `save(keys, frames, hint) -> list[bool]`: write-through to the first tier that answers,
  deduplicated by key; the mover then persists admitted blocks to the capacity tiers in the
  background (from copies of the frames when that tier may drop them first, see
  `store.mover`). No tier failure reaches the caller: an unreachable tier is skipped.
- `finish(keys, hint)`: a request ended (the end of a session's turn).
- `load_within(keys, outs, where, deadline)`: `load` that returns by a deadline whatever the
  tiers do (a stalled lender, an expired lease): blocks not read by then are `MISS`, and the
  transfer still running is handed back, so the caller reuses `outs` only once it is done.
  `expected_load_s(tiers, nbytes)` is what a load should take (`store.rates`, learned from
  this node's loads); `publish_prefill` / `node_prefill` share what the node's engines
  measured of their prefills (`store.counters`).

Callers guarantee what the tier contract asks (sealed frames, big enough out buffers); a
batch holding anything but well-formed keys is refused whole (ValueError), so no string
reaches a tier as a key. The store guarantees: a block is returned only after verification;
every copy between tiers is written (two-phase in the index) before the copy it replaces is
dropped, so a crash at any point leaves each block readable from at least one tier or cleanly
gone; lookups never wait for the mover.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Sequence

from kvtier.store.base.block import HEADER_SIZE
from kvtier.store.base.config import Policy
from kvtier.store.base.errors import TierError, TierUnavailableError
from kvtier.store.base.index import Index
from kvtier.store.base.keys import check_keys
from kvtier.store.base.repeats import thin
from kvtier.store.counters import read_prefill, write_prefill
from kvtier.store.mover import Mover
from kvtier.store.placement import Placement
from kvtier.store.deadline import DeadlineLoads, LoadOutcome
from kvtier.store.rates import LoadRates
from kvtier.tiers.base import MISS, InPlaceRun, Tier, TierContext
from kvtier.tiers.mooncake.master import EmbeddedMaster, ensure_master
from kvtier.tiers.registry import open_tier

log = thin(logging.getLogger(__name__))  # a tier away: one line per message per 10 s
PREFIX_WINDOW = 16  # keys a lookup first asks the tiers below the first about


@dataclass(frozen=True)
class SessionHint:
    """What the serving engine knows about a request's session (overrides inference)."""

    session_id: str | None = None
    expected_gap_s: float | None = None
    gap_class: str | None = None   # at a turn's end: what it waits for ("tool", "user")


@dataclass(frozen=True)
class LookupResult:
    """`hit_blocks`: length of the held prefix; `tiers[i]`: the fastest tier holding block i
    (None for the blocks the caller said it holds)."""

    hit_blocks: int
    tiers: tuple[str | None, ...]


class TieredStore:
    """The node's view of the cluster cache. Thread-safe; one per process."""

    def __init__(self, policy: Policy, *, node_id: str | None = None, mover: bool = True,
                 start_master: bool = True, lend: bool = True, clock=time.time):
        self.policy = policy
        self.node_id = node_id or socket.gethostname()
        self.clock = clock
        self.index = Index(policy.index.path, policy.index.map_size_bytes,
                           policy.index.max_map_size_bytes,
                           identity=f"{policy.namespace.model or '*'}/{policy.namespace.tenant}",
                           chunk_tokens=policy.chunk_tokens)
        self.master: EmbeddedMaster | None = None
        if start_master and any(t.kind == "mooncake" for t in policy.tiers):
            self.master = ensure_master(policy.master)
        ctx = TierContext(self.index, self.node_id, policy.master, lend=lend)
        self.tiers: list[Tier] = []
        try:
            for cfg in policy.tiers:
                self.tiers.append(open_tier(cfg, ctx))
        except BaseException:
            self._close_tiers()
            raise
        self.by_name = {t.name: t for t in self.tiers}
        self.placement = Placement(policy, self.tiers, self.index, clock)
        self.rates = LoadRates({t.name: t.kind for t in self.tiers})
        self._deadlines = DeadlineLoads(self.load, self.rates, self.index)
        self._lenders_taken: dict[str, int] = {}
        self._taken_lock = threading.Lock()
        self.mover = Mover(self.tiers, self.placement, self.index, self.node_id, policy.mover,
                           start=mover, rates=self.rates)
        self._closed = False
        self._lock = threading.Lock()

    @property
    def runs_mover(self) -> bool:
        """Whether this process moves blocks (and so must hear of every lookup and turn end)."""
        return self.mover.running

    def start_mover(self) -> None:
        """Start moving blocks (a store opened lookup-only, then joined by a saving side)."""
        self.mover.start()

    def mover_pending(self) -> int:
        """Blocks queued for the mover (persists and promotions not yet done)."""
        return self.mover.pending()

    def engine_busy(self, busy: bool) -> None:
        """The engine started (True) or ended (False) a prefill: the mover yields to it
        (`mover.yield_to_prefill_s`)."""
        self.mover.engine_busy(busy)

    def engine_stepped(self) -> None:
        """The engine ended a step: persists wait for it to idle (`mover.idle_after_s`)."""
        self.mover.engine_stepped()

    def mover_stats(self) -> dict[str, int]:
        """The mover's counters (blocks copied, dropped, missed), a snapshot."""
        return dict(self.mover.stats)

    # ---- the data path ------------------------------------------------------------------

    def lookup(self, keys: Sequence[str], hint: SessionHint | None = None,
               held: int = 0, observe: bool = True) -> LookupResult:
        """The longest prefix of `keys` present in any tier; never blocks on the mover.

        `held`: leading blocks the caller already has (vLLM's local prefix cache). They count
        in the prefix and attach the request to its session, and are touched where this node
        tracks them, but no tier is asked about them and they are not pinned for a load: a
        16K-token local hit would otherwise pay a 511-key pool query for nothing.
        `tiers[i]` is None for those. `observe=False`: answer only, and leave the bookkeeping
        to the process that runs the mover (`observe_lookup` there)."""
        check_keys(keys)
        if not 0 <= held <= len(keys):
            raise ValueError(f"held={held} is outside 0..{len(keys)} (the number of keys)")
        found = self._prefix_where(keys, held)
        hits = next((i for i in range(held, len(keys)) if found[i] is None), len(keys))
        if observe:
            self.placement.on_lookup(keys, hits, hint, held)
        return LookupResult(hits, tuple(found[:hits]))

    def where(self, keys: Sequence[str]) -> list[str | None]:
        """The fastest tier holding each of `keys` (None: none holds it), each key on its
        own (not a prefix); no bookkeeping: an answer only."""
        check_keys(keys)
        return self._where(keys, 0)

    def _where(self, keys: Sequence[str], start: int) -> list[str | None]:
        found: list[str | None] = [None] * len(keys)
        self._ask(self.tiers, keys, range(start, len(keys)), found)
        return found

    def _prefix_where(self, keys: Sequence[str], start: int) -> list[str | None]:
        """`_where` up to the first key from `start` that no tier holds (the end of the
        prefix; later entries may stay None). The first tier (the pool: one batched query)
        is asked about every key; the tiers below it only about the keys from the first one
        it lacks, in windows of `PREFIX_WINDOW` keys growing 4x, up to the first key none of
        them holds: a cold prompt costs a file tier one window of lookups (on a network
        filesystem, one remote stat each), not one per chunk."""
        found: list[str | None] = [None] * len(keys)
        self._ask(self.tiers[:1], keys, range(start, len(keys)), found)
        at, window = start, PREFIX_WINDOW
        while at < len(keys):
            at = next((i for i in range(at, len(keys)) if found[i] is None), len(keys))
            todo = range(at, min(len(keys), at + window))
            self._ask(self.tiers[1:], keys, todo, found)
            if any(found[i] is None for i in todo):
                break
            at, window = todo.stop, window * 4
        return found

    def _ask(self, tiers: Sequence[Tier], keys: Sequence[str], idx: Sequence[int],
             found: list[str | None]) -> None:
        """Fill `found[i]` (i in `idx`, None so far) with the first of `tiers` holding it."""
        for tier in tiers:
            todo = [i for i in idx if found[i] is None]
            if not todo:
                break
            try:
                present = tier.contains([keys[i] for i in todo])
            except TierError as e:
                log.warning("lookup skips tier %s: %s", tier.name, e)
                continue
            for i, hit in zip(todo, present):
                if hit:
                    found[i] = tier.name

    def observe_lookup(self, keys: Sequence[str], hits: int, hint: SessionHint | None = None,
                       held: int = 0) -> None:
        """A lookup another process of this node made (vLLM's scheduler, when the workers run
        elsewhere): attach the request to its session, touch its blocks and pin the `hits`
        it may load, as `lookup` does, without asking the tiers again."""
        check_keys(keys)
        if not 0 <= held <= hits <= len(keys):
            raise ValueError(f"held={held}, hits={hits} do not fit {len(keys)} keys")
        self.placement.on_lookup(keys, hits, hint, held)

    def load(self, keys: Sequence[str], outs: Sequence[memoryview],
             where: Sequence[str | None] | None = None) -> list[int]:
        """Read each block from the fastest tier that has it; payload length or MISS.

        `where[i]`, when given, is the tier a lookup found block i in (`LookupResult.tiers`):
        that tier is asked first, so a block found below the pool costs no pool round trip;
        one it no longer has is looked for in the other tiers, fastest first."""
        check_keys(keys)
        if where is not None and len(where) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(where)} tier hints; give one per key")
        result = [MISS] * len(keys)
        if where is not None:
            for tier in self.tiers:
                self._load_from(tier, keys, outs, result,
                                [i for i in range(len(keys)) if where[i] == tier.name])
        for tier in self.tiers:
            todo = [i for i in range(len(keys)) if result[i] == MISS
                    and (where is None or where[i] != tier.name)]
            self._load_from(tier, keys, outs, result, todo)
        return result

    def load_within(self, keys: Sequence[str], outs: Sequence[memoryview],
                    where: Sequence[str | None] | None, deadline: float,
                    parts: int = 1, overtime=None) -> LoadOutcome:
        """`load`, returning by `deadline` (`time.monotonic()`) whatever the tiers do,
        or when `overtime` returns (`store.deadline.DeadlineLoads.load_within`)."""
        out = self._deadlines.load_within(keys, outs, where, deadline, parts, overtime)
        late: dict[str, list[str]] = {}
        for lo, hi in out.late_runs:  # counted against the tier each block was expected from
            for i in range(lo, hi):
                tier = self.by_name.get(where[i]) if where is not None else self.tiers[0]
                if tier is not None:
                    tier.stats.add(late=1)
                    late.setdefault(tier.name, []).append(keys[i])
        for name, late_keys in late.items():
            self.by_name[name].blame_late(late_keys)
        return out

    def publish_prefill(self, kind: str, row: dict) -> None:
        """Record this engine's prefill cost model for engines of `kind` on this node."""
        write_prefill(self.index, self.node_id, kind, row)

    def node_prefill(self, kind: str) -> list[dict]:
        """The prefill cost models this node's engines of `kind` published, oldest first."""
        return read_prefill(self.index, kind)

    def lender_failures(self) -> dict[str, int]:
        """Blocks whose load failed or came late, by lender, over this process's tiers."""
        out: dict[str, int] = {}
        for tier in self.tiers:
            for lender, n in tier.lender_failures().items():
                out[lender] = out.get(lender, 0) + n
        return out

    def take_lender_failures(self) -> dict[str, int]:
        """What `lender_failures` gained since the last take (each gain taken once, however
        many callers share this store)."""
        with self._taken_lock:
            now = self.lender_failures()
            gained = {k: n - self._lenders_taken.get(k, 0) for k, n in now.items()
                      if n > self._lenders_taken.get(k, 0)}
            self._lenders_taken = now
        return gained

    def expected_load_s(self, tiers: Sequence[str | None], nbytes_each: int
                        ) -> tuple[float, bool]:
        """(Seconds a load of blocks of `nbytes_each` found in `tiers` should take, whether
        that was measured on this node rather than guessed)."""
        return self._deadlines.expected_s(tiers, nbytes_each)

    def locate(self, keys: Sequence[str], where: Sequence[str | None] | None = None
               ) -> list[InPlaceRun]:
        """Runs of blocks the first tier lets the caller read where they lie, without a copy
        (`Tier.locate`; block indices refer to `keys`). Only blocks the lookup found there
        (`where`) are asked about. Unverified: read them, then `confirm` what was used."""
        first = self.tiers[0]
        idx = [i for i in range(len(keys)) if where is None or where[i] == first.name]
        if not idx:
            return []
        try:
            runs = first.locate([keys[i] for i in idx])
        except TierError as e:
            log.warning("in-place read skips tier %s: %s", first.name, e)
            return []
        out = []
        for run in runs:  # a run of `idx` positions is a run of `keys` where idx is consecutive
            start = run.first
            for j in range(run.first + 1, run.first + run.count + 1):
                if j == run.first + run.count or idx[j] != idx[j - 1] + 1:
                    out.append(replace(
                        run, first=idx[start], count=j - start,
                        offset=run.offset + (start - run.first) * run.stride))
                    start = j
        return out

    def confirm(self, keys: Sequence[str], runs: Sequence[InPlaceRun],
                checksums: Sequence[int | None]) -> list[int]:
        """After reading `runs` (from `locate`): payload length per key of what was read
        intact, else `MISS` (load those the usual way). `checksums`: the caller's, of the
        payloads it used, where it used them (`Tier.verify_in_place`)."""
        got = self.tiers[0].verify_in_place(keys, runs, checksums)
        hits = [k for k, n in zip(keys, got) if n != MISS]
        if hits:
            self.placement.on_hit(self.tiers[0], hits)
        return got

    def _load_from(self, tier: Tier, keys: Sequence[str], outs: Sequence[memoryview],
                   result: list[int], todo: list[int]) -> None:
        """Read blocks `todo` from `tier` into `outs`, filling `result` where it has them."""
        if not todo:
            return
        t0 = time.monotonic()
        try:
            got = tier.get([keys[i] for i in todo], [outs[i] for i in todo])
        except TierError as e:
            log.warning("load skips tier %s: %s", tier.name, e)
            return
        hits = [i for i, n in zip(todo, got) if n != MISS]
        if hits:
            self.rates.observe(tier.name, sum(got[i] + HEADER_SIZE for i in range(len(got))
                                              if got[i] != MISS), time.monotonic() - t0)
        for i, n in zip(todo, got):
            if n != MISS:
                result[i] = n
        if hits:
            self.placement.on_hit(tier, [keys[i] for i in hits])
            if tier is not self.tiers[0]:
                self.mover.promote([keys[i] for i in hits], tier.name)

    def save(self, keys: Sequence[str], frames: Sequence[memoryview],
             hint: SessionHint | None = None) -> list[bool]:
        """Write-through to the first tier that answers (deduplicated); the mover persists
        below it. A tier that cannot be reached (the pool while its master is down) is
        skipped, so saves keep landing in the capacity tiers and never fail the caller."""
        check_keys(keys)
        for tier in self.tiers:
            try:
                return self._save_to(tier, keys, frames, hint)
            except TierUnavailableError as e:
                log.warning("save skips tier %s: %s", tier.name, e)
        return [False] * len(keys)

    def _save_to(self, first: Tier, keys: Sequence[str], frames: Sequence[memoryview],
                 hint: SessionHint | None) -> list[bool]:
        present = first.contains(keys)
        new = [i for i, p in enumerate(present) if not p]
        stored = list(present)
        fresh: dict[str, memoryview] = {}  # the frames of blocks new to `first`, for the mover
        refused: list[str] = []
        if new:
            self.mover.make_room(first, sum(len(frames[i]) for i in new))
            # TierUnavailableError goes up: save() hands the batch to the next tier
            ok = self.mover.copier.put(first, [keys[i] for i in new], [frames[i] for i in new])
            for i, good in zip(new, ok):
                stored[i] = good
            fresh = {keys[i]: frames[i] for i in new}
            put = [keys[i] for i, good in zip(new, ok) if good]
            self.placement.on_insert(first, put, [len(fresh[k]) for k in put], hint)
            refused = [keys[i] for i, good in zip(new, ok) if not good]
        # Refused blocks (a full pool) go down from copies of their frames: False still
        # tells the caller they are not stored yet.
        self.mover.persist([k for k, s in zip(keys, stored) if s], first.name, hint, fresh,
                           refused)
        return stored

    def finish(self, keys: Sequence[str], hint: SessionHint | None = None) -> None:
        """A request over these keys ended: the session's turn is over. Its row reaches the
        index a moment later, written off this thread (`flush_sessions` waits for it)."""
        self.placement.on_finish(keys, hint)

    def flush_sessions(self) -> None:
        """Return once the rows of every turn ended so far are in the index."""
        self.placement.rows.flush()

    # ---- housekeeping -------------------------------------------------------------------

    def usage(self) -> dict[str, dict[str, int]]:
        """Capacity, used bytes and counters of every tier (the mover's among them)."""
        return self.mover.usage()

    def save_counters(self) -> None:
        """Record this process's tier counters in the index (for `kvtier inspect`)."""
        self.mover.save_counters()

    def close(self) -> None:
        """Stop the mover (draining queued persists), close tiers and index. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.mover.stop()
        self._deadlines.close()
        self.save_counters()
        self._close_tiers()
        self.placement.rows.close()
        self.index.close()

    def _close_tiers(self) -> None:
        for tier in reversed(self.tiers):
            try:
                tier.close()
            except TierError as e:
                log.warning("closing tier %s: %s", tier.name, e)

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
