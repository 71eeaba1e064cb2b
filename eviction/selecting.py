"""`agentic` with `select: true`: follow whichever candidate ranking hits most, online.

No ranking wins everywhere: agentic's session predictions lead on agent loops, a classic
policy may lead on a workload nobody tuned agentic on. So the tier runs one candidate (at
first agentic) and keeps a miniature simulation of each (`eviction.shadow`: a hash-sampled
share of the sessions, the capacity scaled by the same share) fed with every lookup. Each
shadow's hit bytes decay over `select_window` sampled lookups (an exponential window); the
tier switches to the leader when its lead over the followed candidate is more than
`select_margin` of the bytes looked up (points of hit rate: the same at a 20% hit rate as
at 90%) and more than twice the standard error of the mean lead per lookup (sampled
sessions are few on a small node: noise must not switch), and the followed one has been
followed for a quarter window (hysteresis).

A switch rebuilds the new candidate from the tier's keys, least recent first, each touched
again as many times as it was read while in the tier (up to 3, s3fifo's cap): an LRU switch
is exact, s3fifo and arc keep what they tell apart by reads (s3fifo's frequencies, arc's
second list) though not their ghosts, agentic reads the session tracker as it is now. The
sampling share is what makes a shadow hold `select_shadow_blocks` blocks (of
`PolicyContext.block_bytes`, else of the first key's size: a tier's keys are blocks), as in
SHARDS' fixed-size mode: a miniature simulation's accuracy depends on how much it holds,
not on the share, so a larger tier samples a smaller share and the shadows' state and work
stay bounded (`select_sample_rate` is an optional floor on the share). Only agentic's
demotions and prefetches run, and only while agentic is followed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from kvtier.eviction.base import NO_META, BlockMeta, EvictionPolicy, Key, PolicyContext
from kvtier.eviction.shadow import ChainSampler, ShadowCache
from kvtier.store.base.policies import EVICTION_KINDS

_MAX_READS = 3  # reads a rebuilt candidate replays per key (s3fifo's frequency cap)


class SelectingPolicy(EvictionPolicy):
    kind = "agentic"
    needs_sessions = True

    def __init__(self, config, ctx: PolicyContext, make):
        super().__init__(config, ctx)
        self._make = make
        self.configs = {name: (config.model_copy(update={"select": False}) if name == "agentic"
                               else EVICTION_KINDS[name](kind=name))
                        for name in config.select_candidates}
        self.following = next(iter(self.configs))
        self.live = make(self.configs[self.following], ctx)
        self.keys: OrderedDict[Key, int] = OrderedDict()  # least recent first
        self.reads: dict[Key, int] = {}  # reads of a key while in the tier, up to _MAX_READS
        self.sampler: ChainSampler | None = None
        self.shadows: dict[str, ShadowCache] = {}
        self.score = dict.fromkeys(self.configs, 0.0)   # decayed hit bytes
        # decayed sums of each candidate's lead over the followed one, per sampled lookup:
        # count, sum, sum of squares (reset at a switch)
        self.lead = {name: [0.0, 0.0, 0.0] for name in self.configs}
        self.looked = 0.0                               # decayed lookup bytes
        self.sampled = 0          # sampled lookups so far
        self.since = 0            # sampled lookups at the last switch
        self.switches = 0
        self._decay = 1.0 - 1.0 / config.select_window

    # ---- the tier's own bookkeeping, passed to the followed candidate -----------------------
    def on_insert(self, key: Key, size: int, now: float, meta: BlockMeta = NO_META) -> None:
        if key in self.keys:
            self._read(key)
        self.keys[key] = size
        self.keys.move_to_end(key)
        self.live.on_insert(key, size, now, meta)
        self.used_bytes = self.live.used_bytes

    def on_access(self, key: Key, now: float, meta: BlockMeta = NO_META) -> None:
        if key in self.keys:
            self.keys.move_to_end(key)
            self._read(key)
            self.live.on_access(key, now, meta)

    def _read(self, key: Key) -> None:
        self.reads[key] = min(self.reads.get(key, 0) + 1, _MAX_READS)

    def on_remove(self, key: Key) -> None:
        if self.keys.pop(key, None) is not None:
            self.reads.pop(key, None)
            self.live.on_remove(key)
            self.used_bytes = self.live.used_bytes

    def select_victims(self, need_bytes: int, now: float,
                       skip: Collection[Key] = ()) -> list[Key]:
        return self.live.select_victims(need_bytes, now, skip)

    def select_demotions(self, now: float, max_bytes: int) -> list[Key]:
        return self.live.select_demotions(now, max_bytes)

    def select_prefetch(self, now: float, max_bytes: int) -> list[Key]:
        return self.live.select_prefetch(now, max_bytes)

    def on_tick(self, now: float) -> None:
        self.live.on_tick(now)
        for sh in self.shadows.values():
            sh.tick(now)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    # ---- the miniature simulations ----------------------------------------------------------
    def _start(self, block_bytes: int) -> None:
        cfg, cap = self.config, max(1, self.capacity_bytes)
        rate = min(1.0, max(cfg.select_sample_rate, cfg.select_shadow_blocks * block_bytes / cap))
        self.sampler = ChainSampler(rate)
        for name, c in self.configs.items():
            self.shadows[name] = ShadowCache(name, lambda ctx, c=c: self._make(c, ctx),
                                             cap * rate, self.ctx)

    def on_lookup(self, keys, now: float, meta_of, size_of) -> None:
        if not keys:
            return
        if self.sampler is None:
            self._start(self.ctx.block_bytes or size_of(keys[0]))
        if not self.sampler.keeps(keys, meta_of):
            return
        d = self._decay
        metas, sizes = [meta_of(k) for k in keys], [size_of(k) for k in keys]
        hits = {name: sh.lookup(keys, now, metas, sizes) for name, sh in self.shadows.items()}
        base = hits[self.following]
        for name, hit in hits.items():
            self.score[name] = self.score[name] * d + hit
            lead = self.lead[name]
            x = hit - base
            lead[0], lead[1], lead[2] = lead[0] * d + 1, lead[1] * d + x, lead[2] * d + x * x
        self.looked = self.looked * d + sum(sizes)
        self.sampled += 1
        self._maybe_switch(now, meta_of)

    def _significant(self, name: str) -> bool:
        """Does `name` lead the followed candidate by the margin (a share of the bytes looked
        up), and by more than twice the standard error of its mean lead per lookup (so
        sampling noise does not switch)?"""
        n, s1, s2 = self.lead[name]
        if n < 2 or s1 <= self.config.select_margin * self.looked:
            return False
        mean = s1 / n
        var = max(s2 / n - mean * mean, 0.0)
        return mean > 2.0 * (var / n) ** 0.5

    def _maybe_switch(self, now: float, meta_of) -> None:
        best = max(self.score, key=self.score.get)
        if best == self.following or self.sampled - self.since < self.config.select_window // 4 \
                or not self._significant(best):
            return
        live = self._make(self.configs[best], self.ctx)
        for key, size in self.keys.items():
            meta = meta_of(key)
            live.on_insert(key, size, now, meta)
            for _ in range(self.reads.get(key, 0)):
                live.on_access(key, now, meta)
        self.live, self.following = live, best
        self.since, self.switches = self.sampled, self.switches + 1
        self.lead = {name: [0.0, 0.0, 0.0] for name in self.configs}
        self.used_bytes = live.used_bytes

    def selection(self) -> dict:
        """What `inspect` shows: the candidate followed now, each shadow's hit rate over the
        recent window and overall, the sampling share and the shadows' size."""
        looked = max(self.looked, 1e-300)
        return {
            "following": self.following, "switches": self.switches,
            "sample_rate": self.sampler.rate if self.sampler else None,
            "sampled_lookups": self.sampled,
            "shadow_entries": sum(len(s) for s in self.shadows.values()),
            "shadows": {name: {"recent_hit_pct": 100.0 * self.score[name] / looked
                               if self.looked else None,
                               "hit_pct": 100.0 * sh.hit_bytes / max(sh.lookup_bytes, 1)}
                        for name, sh in self.shadows.items()},
        }
