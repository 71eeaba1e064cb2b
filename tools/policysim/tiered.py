"""Tiered policy-only replay: a small pool (dram) over nvme over sharedfs.

The same time semantics as `tools.policysim.replay.Replay`, over three tiers, each with its own
policy instance (one kind for all, e.g. `lru` everywhere against `agentic` everywhere), and
the store's admission filter (`eviction.admission`) in front of the capacity tiers. A block
lives in one tier at a time:
- a save writes to dram; dram victims are demoted to nvme if admitted there, else to
  sharedfs if admitted there, else dropped; nvme victims go to sharedfs (same rule);
  sharedfs victims are dropped;
- a hit in a lower tier is a hit (no recompute) and promotes the block back to dram;
- every `mover_period_s`, the mover asks dram's policy for early demotions
  (`select_demotions`) and the lower tiers' policies for prefetches (`select_prefetch`,
  into dram's free room); a prefetch lands after `bytes / restore_bytes_per_s` of its tier
  (one transfer at a time per tier) and counts as dram only from then on.
Reported: the tiered token hit rate, and the share of hit tokens served from dram.
"""

from __future__ import annotations

import heapq
from collections import namedtuple

from kvtier.eviction import PolicyContext, make_policy
from kvtier.eviction.admission import make_admission
from kvtier.store.base.policies import ADMISSION_KINDS
from kvtier.tools.policysim.replay import Replay, SimParams, policy_config

SimTier = namedtuple("SimTier", "name kind capacity_bytes restore_bps")
_DRAM, _NONE = 0, 255
RESTORE_BPS = {"mooncake": 8e9, "nvme": 1.5e9, "sharedfs": 0.5e9}  # as store.placement


class TieredReplay(Replay):
    """One policy kind on every tier; capacities in bytes for (dram, nvme, sharedfs)."""

    def __init__(self, c, policy, capacities: tuple[float, float, float],
                 p: SimParams = SimParams(), admission="reuse", mover_period_s: float = 1.0):
        super().__init__(c, policy, capacities[0], p)
        kinds = ("mooncake", "nvme", "sharedfs")
        self.tiers = [SimTier(n, k, int(min(cap, 2**62)), RESTORE_BPS[k])
                      for n, k, cap in zip(("dram", "nvme", "sharedfs"), kinds, capacities)]
        self.policies = [self.policy] + [
            make_policy(policy_config(policy), PolicyContext(
                t.capacity_bytes, t.name, self.tracker, self.future, t.restore_bps,
                self.block_bytes))
            for t in self.tiers[1:]]
        self.tier_used = [0, 0, 0]
        self.where = bytearray([_NONE]) * c.n_segments
        self.now = 0.0
        adm = ADMISSION_KINDS[admission](kind=admission) if isinstance(admission, str) \
            else admission
        self.admission = make_admission(adm, self.tiers, self.tracker, lambda: self.now)
        self.period = mover_period_s
        self.prefetch_fraction = 0.25  # of dram, per mover pass
        self.next_move = 0.0
        self.busy_until = [0.0, 0.0, 0.0]
        self.inflight: set[int] = set()
        self.dram_hit_tokens = 0

    # ---- the data path -------------------------------------------------------------------
    def _lookup(self, r: int, t: float):
        self.now = t
        while self.pending and self.pending[0][0] <= t:  # prefetches landing first
            self._event(*heapq.heappop(self.pending))
        if t >= self.next_move:
            self._mover(t)
            self.next_move = t + self.period
        lo = self.off[r]
        segs, turn = self._arrive(r, t)
        where, h = self.where, 0
        for s in segs:
            if where[s] == _NONE:
                break
            h += 1
        meta = self.tracker.meta
        for pol in self.policies:
            pol.on_lookup(segs, t, meta, self.size.__getitem__)
        dram_blocks = 0
        for j in range(h - 1, -1, -1):
            s = segs[j]
            tier = where[s]
            self.policies[tier].on_access(s, t, meta(s))
            if tier == _DRAM:
                dram_blocks += self.c.seg_blocks[s]
            else:
                self._move(s, tier, _DRAM, t)  # promotion on hit
        if h:
            covered = self.cum[lo + h - 1]
            tokens = min(covered * self.c.work.block_tokens, self.c.work.input_tokens[r])
            self.dram_hit_tokens += tokens * dram_blocks / covered
        return h, turn.session

    def _save(self, t: float, r: int, h: int, sid) -> None:
        self.now = t
        meta, pol = self.tracker.meta, self.policy
        segs = self.seg[self.off[r]:self.off[r + 1]]
        for j in range(len(segs) - 1, h - 1, -1):
            s = segs[j]
            if self.where[s] == _NONE:
                self._place(s, _DRAM, t)
            elif self.where[s] == _DRAM:
                pol.on_access(s, t, meta(s))
        self._fit(_DRAM, t)

    def _event(self, t: float, kind: int, r: int, h: int, sid) -> None:
        if kind == 2:  # a prefetch landed
            self.now = t
            self.inflight.discard(r)
            if self.where[r] not in (_NONE, _DRAM):
                self._move(r, self.where[r], _DRAM, t)
            return
        super()._event(t, kind, r, h, sid)

    # ---- moves ---------------------------------------------------------------------------
    def _place(self, s: int, tier: int, t: float) -> None:
        self.where[s] = tier
        self.tier_used[tier] += self.size[s]
        self.policies[tier].on_insert(s, self.size[s], t, self.tracker.meta(s))

    def _take(self, s: int) -> int:
        tier = self.where[s]
        self.policies[tier].on_remove(s)
        self.tier_used[tier] -= self.size[s]
        self.where[s] = _NONE
        return tier

    def _move(self, s: int, src: int, dst: int, t: float) -> None:
        self._take(s)
        self._place(s, dst, t)
        if dst == _DRAM:
            self._fit(_DRAM, t)

    def _fit(self, tier: int, t: float) -> None:
        """Evict from `tier` down to its capacity, demoting what the tiers below admit."""
        over = self.tier_used[tier] - self.tiers[tier].capacity_bytes
        if over <= 0:
            return
        victims = self.policies[tier].select_victims(over, t)
        for v in victims:
            self._demote(v, tier, t)
        if self.tier_used[tier] > self.tiers[tier].capacity_bytes:
            raise AssertionError(f"{self.tiers[tier].name}: select_victims freed too little")

    def _demote(self, s: int, tier: int, t: float) -> None:
        self._take(s)
        for below in range(tier + 1, len(self.tiers)):
            if self.admission.admit(self.tiers[below], [s], [self.size[s]])[0]:
                self._place(s, below, t)
                self._fit(below, t)
                return  # else dropped: no tier below admitted it

    def _mover(self, t: float) -> None:
        """Prefetch what the lower tiers' policies expect back soon into dram's free room,
        making room first by demoting dram's cold sessions (never anything hot)."""
        dram = self.tiers[_DRAM]
        budget = int(dram.capacity_bytes * self.prefetch_fraction)
        wanted = [(tier, s) for tier in range(1, len(self.tiers))
                  for s in self.policies[tier].select_prefetch(t, budget)
                  if s not in self.inflight and self.where[s] == tier]
        if not wanted:
            return
        need = sum(self.size[s] for _, s in wanted) - (dram.capacity_bytes
                                                       - self.tier_used[_DRAM])
        if need > 0:
            for s in self.policies[_DRAM].select_demotions(t, need):
                self._demote(s, _DRAM, t)
        room = dram.capacity_bytes - self.tier_used[_DRAM]
        for tier, s in wanted:
            if self.size[s] > room:
                break
            start = max(t, self.busy_until[tier])
            self.busy_until[tier] = start + self.size[s] / self.tiers[tier].restore_bps
            self.inflight.add(s)
            heapq.heappush(self.pending, (self.busy_until[tier], 2, s, 0, None))
            room -= self.size[s]
