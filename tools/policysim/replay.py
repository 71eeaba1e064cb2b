"""Policy-only replay (`kvtier replay --simulate`): hit rates without moving a byte.

A compiled workload (`tools.policysim.segments`) is replayed through the store's metadata path: the
session tracker (`store.sessions.tracker`) and one eviction policy (`eviction`) over one tier of a
given capacity. Time semantics:
- at a request's arrival its chain is looked up: the hit is the longest cached prefix, and the
  policy sees `on_access` for the hit segments, tail first (so the head is the most recent);
- its missing segments are saved after prefill (`miss tokens / prefill_tokens_per_s`, never
  after the same session's next arrival): `on_insert`, tail first, then eviction down to
  the capacity with `select_victims`;
- its turn ends when the response is done (the trace's service time, at least the prefill,
  never after the same session's next arrival): `end_turn` with the gap class the trace
  knows at that point (what a connector sees when a request finishes);
- the session tracker infers sessions from keys alone (no session ids are passed) and is
  reaped every `reap_every` requests.
Sizes are `blocks * block_tokens * bytes_per_token`. The token hit rate is hit tokens
(cached leading blocks, capped at the input length) over input tokens.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from kvtier.eviction import PolicyContext, make_policy
from kvtier.store.base.policies import EVICTION_KINDS
from kvtier.store.sessions.stats import GapPrior
from kvtier.store.sessions.tracker import SessionConfig, SessionTracker
from kvtier.tools.policysim.segments import Compiled


@dataclass(frozen=True)
class SimParams:
    bytes_per_token: int = 131_072      # llama-3-8B, bf16: 2 * 32 layers * 8 heads * 128 * 2
    prefill_tokens_per_s: float = 20_000.0
    reap_every: int = 256


class OracleFuture:
    """`NextUse` for belady: the index of the next request that reads a segment, kept
    current by the simulator as lookups happen."""

    def __init__(self, c: Compiled):
        self.nu = [math.inf] * c.n_segments

    def next_use(self, key) -> float:
        return self.nu[key]


SELECT = "+select"  # a policy name's suffix: agentic with online selection on


def policy_config(kind_or_cfg):
    """A policy config from a config or a name (`agentic+select`: agentic, `select: true`)."""
    if isinstance(kind_or_cfg, str):
        kind, select = kind_or_cfg.removesuffix(SELECT), kind_or_cfg.endswith(SELECT)
        return EVICTION_KINDS[kind](kind=kind, **({"select": True} if select else {}))
    return kind_or_cfg


def tracker_for(cfg) -> SessionTracker:
    prior = GapPrior(median_s=getattr(cfg, "prior_gap_s", GapPrior.median_s))
    return SessionTracker(SessionConfig(prior=prior))


class Replay:
    """One policy at one capacity over one compiled workload; `run()` returns hit tokens."""

    def __init__(self, c: Compiled, policy, capacity_bytes: float, p: SimParams = SimParams()):
        cfg = policy_config(policy)
        self.c, self.p, self.cfg = c, p, cfg
        w = c.work
        self.tracker = tracker_for(cfg)
        self.future = OracleFuture(c)
        cap = int(min(capacity_bytes, 2**62))
        self.capacity = cap
        # the replay's keys are runs of blocks: selection sizes its shadows in blocks
        self.block_bytes = w.block_tokens * p.bytes_per_token
        self.policy = make_policy(cfg, PolicyContext(cap, "sim", self.tracker, self.future,
                                                     block_bytes=self.block_bytes))
        self.size = (c.seg_blocks * self.block_bytes).tolist()
        self.seg, self.off = c.seg.tolist(), c.seg_off.tolist()
        self.cum, self.nxt = c.cum_blocks.tolist(), c.next_req.tolist()
        self.cached = bytearray(c.n_segments)
        self.used = 0
        self.pending: list[tuple] = []
        self.hit_tokens = 0
        self.evicted_bytes = 0

    def run(self) -> int:
        w, c = self.c.work, self.c
        arrival, n_in = w.arrival_s.tolist(), w.input_tokens.tolist()
        next_same = c.next_same.tolist()
        bt, rate = w.block_tokens, self.p.prefill_tokens_per_s
        service = self.c.work.service_s.tolist()
        for r in range(len(arrival)):
            t = arrival[r]
            while self.pending and self.pending[0][0] <= t:
                self._event(*heapq.heappop(self.pending))
            h, sid = self._lookup(r, t)
            hit = min(self.cum[self.off[r] + h - 1] * bt, n_in[r]) if h else 0
            self.hit_tokens += hit
            saved = min(t + (n_in[r] - hit) / rate, next_same[r])
            ended = min(max(t + service[r], saved), next_same[r])
            heapq.heappush(self.pending, (saved, 0, r, h, sid))
            heapq.heappush(self.pending, (ended, 1, r, h, sid))
            if r % self.p.reap_every == 0:
                self.tracker.reap(t)
        while self.pending:
            self._event(*heapq.heappop(self.pending))
        return self.hit_tokens

    def _event(self, t: float, kind: int, r: int, h: int, sid) -> None:
        if kind == 0:
            self._save(t, r, h, sid)
        else:
            self.tracker.end_turn(sid, t, self.c.work.gap_names[self.c.work.gap_class[r]],
                                  expected_gap_s=self._gap_hint(t, r))

    def _gap_hint(self, t: float, r: int) -> float | None:
        """The `expected_gap_s` hint at the end of request `r`'s turn: none (a connector
        without hints); `tools.policysim.oracle` gives the true gap."""
        return None

    def _arrive(self, r: int, t: float):
        """Request `r` arrives at `t`: its segments, the oracle's next uses of them, and the
        turn the session tracker attaches it to; (segments, turn)."""
        lo, hi = self.off[r], self.off[r + 1]
        segs = self.seg[lo:hi]
        nu, nxt = self.future.nu, self.nxt
        for i in range(lo, hi):
            nu[self.seg[i]] = nxt[i]
        return segs, self.tracker.observe(segs, t)

    def _lookup(self, r: int, t: float) -> tuple[int, object]:
        segs, turn = self._arrive(r, t)
        cached, h = self.cached, 0
        for s in segs:
            if not cached[s]:
                break
            h += 1
        meta, access = self.tracker.meta, self.policy.on_access
        self.policy.on_lookup(segs, t, meta, self.size.__getitem__)
        for j in range(h - 1, -1, -1):
            access(segs[j], t, meta(segs[j]))
        return h, turn.session

    def _save(self, t: float, r: int, h: int, sid) -> None:
        segs = self.seg[self.off[r]:self.off[r + 1]]
        meta, pol, cached, size = self.tracker.meta, self.policy, self.cached, self.size
        for j in range(len(segs) - 1, h - 1, -1):
            s = segs[j]
            if cached[s]:
                pol.on_access(s, t, meta(s))
            else:
                pol.on_insert(s, size[s], t, meta(s))
                cached[s] = 1
                self.used += size[s]
        if self.used > self.capacity:
            self._evict(t)

    def _evict(self, t: float) -> None:
        victims = self.policy.select_victims(self.used - self.capacity, t)
        for v in victims:
            self.policy.on_remove(v)
            self.cached[v] = 0
            self.used -= self.size[v]
            self.evicted_bytes += self.size[v]
        if self.used > self.capacity:
            raise AssertionError(f"{self.cfg.kind}: select_victims freed too little "
                                 f"({self.used} > {self.capacity})")


def total_input_tokens(c: Compiled) -> int:
    return int(np.asarray(c.work.input_tokens).sum())
