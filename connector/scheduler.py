"""Scheduler side: which chunks of a request to load from kvtier and which to save.

- `get_num_new_matched_tokens`: keys for the request's full chunks (leaving at least one
  token to compute), one batched `store.lookup` of the whole chain (the store attaches the
  request to its session by it; only the chunks past vLLM's local hit are looked for in the
  tiers), and the part of the hit beyond vLLM's local hit. The hit is in whole chunks; a
  chunk that starts inside the local hit is loaded without overwriting the local blocks. The
  load is asynchronous, or synchronous (done before the forward of the step that schedules
  the request) by the connector's `load` setting; `auto` loads synchronously when no other
  request of the engine is running (nothing for the load to overlap with).
- `update_state_after_alloc`: turns the hit into a `LoadJob` over the allocated blocks.
- `build_connector_meta`: tracks every scheduled request's block ids, and emits a `SaveJob`
  for each chunk whose KV is complete after this step and not known to be in kvtier
  (chunks loaded from kvtier or covered by a local hit are not saved again).
- `request_finished`: saves the last complete chunks if any are left (their token ids only
  became known now), keeping the request's blocks (returns True) until the worker has
  gathered them and reports `finished_sending`; tells the store the turn ended
  (`store.finish` with the keys it looked up). Session hints from `kv_transfer_params`
  ride along to lookup, save and finish; without them the store infers the session.

When the workers run in other processes (`vllm serve` with a multiprocess executor), the
store here only answers lookups; the lookups and turn ends go to the workers' stores, whose
movers evict and prefetch by them, as `StoreEvent`s in the next step's metadata
(`has_pending_push_work` keeps the engine stepping until the last of them is out).

A preempted request is looked up again when it resumes, so what it saved comes back from
kvtier instead of being recomputed.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector import storeref
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.metadata import KVTierMetadata, LoadJob, SaveJob, StoreEvent
from kvtier.connector.naming import (kv_shape, make_namespace, request_salt, session_hint,
                                     token_keys)
from kvtier.connector.stats import KVTierStats
from kvtier.connector.tool_calls import detect_tool_call_ids, gap_class
from kvtier.store.base.errors import KVTierError
from kvtier.store.placement import PIN_S
from kvtier.store.tiered import SessionHint

log = logging.getLogger(__name__)
# A request vLLM keeps asking about renews its pins in the workers' stores this often (they
# last `PIN_S` there).
PIN_RENEW_S = PIN_S / 3

# Where each tier kind sits in vLLM's cache-hit-source taxonomy.
_HIT_SOURCE = {"mooncake": CacheHitSource.HOST, "nvme": CacheHitSource.DISK,
               "sharedfs": CacheHitSource.DISK}


@dataclass
class _Plan:
    """The last lookup's answer for a request: chunks [first, first + hits) are in kvtier."""

    num_computed: int
    first: int
    hits: int
    tiers: tuple[str, ...]
    sync: bool


@dataclass
class _Req:
    request: Any
    salt: bytes
    hint: SessionHint | None
    keys: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0          # chunks [0, saved_upto) are in kvtier or handed to a save
    loaded_upto: int | None = None
    plan: _Plan | None = None
    sources: dict[CacheHitSource, int] = field(default_factory=dict)
    tier_tokens: dict[str, int] = field(default_factory=dict)
    looked_up: list[str] = field(default_factory=list)  # the keys of the last lookup
    saved_chunks: int = 0
    loads: dict[str, int] = field(default_factory=lambda: {"async": 0, "sync": 0})
    scheduled: bool = False      # its blocks hold computed (or loaded) KV
    forwarded: tuple = ()        # (chunks, hits, held, when) of the last lookup forwarded


class SchedulerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig):
        self.shape = kv_shape(kv_cache_config)
        self.ns = make_namespace(vllm_config, self.shape, cfg.policy)
        self.chunk = cfg.policy.chunk_tokens
        self.m = self.chunk // self.shape.block_size
        self.tier_kinds = {t.name: t.kind for t in cfg.policy.tiers}
        self.load_mode = cfg.load
        self.tool_call_ids = detect_tool_call_ids(vllm_config.model_config) \
            if cfg.tool_call_token_ids == "auto" else frozenset(cfg.tool_call_token_ids)
        self._running = 0  # requests scheduled and not finished (for `load: auto`)
        self.store = storeref.acquire(cfg.policy, cfg.node_id, mover=False)
        # The worker side is built first in a shared process (storeref): a store without a
        # mover means the workers, and the stores that act on sessions, are elsewhere.
        self.forward = not self.store.runs_mover
        self._events: list[StoreEvent] = []
        self.reqs: dict[str, _Req] = {}
        self.stats = KVTierStats()
        self._loads: list[LoadJob] = []
        self._hold: list[str] = []
        self._saves: list[SaveJob] = []

    # ---- lookup and load ----------------------------------------------------------------

    def _state(self, request: Any) -> _Req | None:
        st = self.reqs.get(request.request_id)
        if st is None:
            salt = request_salt(request)
            if salt is None:
                return None
            st = self.reqs[request.request_id] = _Req(request, salt, session_hint(request))
        return st

    def _keys(self, st: _Req, n_chunks: int) -> list[str]:
        have = len(st.keys)
        if have < n_chunks:  # a request's tokens only grow: extend its chain
            tokens = st.request.all_token_ids[have * self.chunk: n_chunks * self.chunk]
            st.keys = st.keys + token_keys(self.ns, tokens, st.salt,
                                           st.keys[-1] if st.keys else None)
        return st.keys[:n_chunks]

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        st = self._state(request)
        limit = (request.num_tokens - 1) // self.chunk  # keep >= 1 token to compute
        if st is None or limit == 0:
            return 0, False
        # The whole chain from the first chunk, also when vLLM holds a prefix locally: the
        # store attaches the request to its session by it, and touches what is held. Only
        # the chunks past the local hit are looked for in the tiers.
        keys = self._keys(st, limit)
        first = num_computed // self.chunk
        t0 = time.perf_counter()
        try:
            found = self.store.lookup(keys, st.hint, held=min(first, limit),
                                      observe=not self.forward)
        except KVTierError as e:
            log.warning("kvtier: lookup failed, serving request %s without it: %s",
                        request.request_id, e)
            return 0, False
        st.looked_up = keys
        if self.forward:
            self._forward_lookup(st, keys, found.hit_blocks, min(first, limit))
        log.debug("kvtier: lookup %s: %d of %d chunks (%d held locally) in %.2f ms",
                  request.request_id, found.hit_blocks, limit, min(first, limit),
                  (time.perf_counter() - t0) * 1e3)
        self.stats.add("lookups")
        self.stats.add("lookup_tokens", max(0, limit * self.chunk - num_computed))
        external = found.hit_blocks * self.chunk - num_computed
        if found.hit_blocks <= first or external <= 0:
            st.plan = None
            return 0, False
        sync = self._load_sync(st)
        st.plan = _Plan(num_computed, first, found.hit_blocks - first, found.tiers[first:], sync)
        return external, not sync

    def _load_sync(self, st: _Req) -> bool:
        if self.load_mode != "auto":
            return self.load_mode == "sync"
        return self._running == 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None or num_external == 0 or st.plan is None:
            return
        plan, st.plan = st.plan, None
        ids = blocks.get_block_ids()[0]
        n = min(plan.hits, -(-(plan.num_computed + num_external) // self.chunk) - plan.first)
        m = self.m
        rows = [ids[c * m:(c + 1) * m] for c in range(plan.first, plan.first + n)]
        skip = plan.num_computed // self.shape.block_size - plan.first * self.m
        self._loads.append(LoadJob(request.request_id, st.keys[plan.first:plan.first + n],
                                   rows, skip, list(plan.tiers[:n]), plan.sync))
        st.loads["sync" if plan.sync else "async"] += 1
        st.loaded_upto = st.saved_upto = plan.first + n
        st.sources = self._account(st, plan, n, num_external)

    def _account(self, st: _Req, plan: _Plan, n: int, num_external: int
                 ) -> dict[CacheHitSource, int]:
        """Tokens promised per tier (stats), and per vLLM cache-hit source."""
        out: dict[CacheHitSource, int] = {}
        left = num_external
        first = True
        for tier, run in itertools.groupby(plan.tiers[:n]):  # a run of chunks in one tier
            cap = sum(1 for _ in run) * self.chunk
            if first:
                cap -= plan.num_computed % self.chunk
                first = False
            tokens = min(left, cap)
            left -= tokens
            self.stats.add(f"hit_tokens:{tier}", tokens)
            st.tier_tokens[tier] = st.tier_tokens.get(tier, 0) + tokens
            src = _HIT_SOURCE.get(self.tier_kinds.get(tier, ""),
                                  CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + tokens
        return {k: v for k, v in out.items() if v}

    def hit_sources(self, request: Any, num_external: int) -> dict[CacheHitSource, int]:
        st = self.reqs.get(request.request_id)
        if st is None or sum(st.sources.values()) != num_external:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external} if num_external else {}
        return dict(st.sources)

    # ---- per step: block tracking and saves ---------------------------------------------

    def build_connector_meta(self, out: Any) -> KVTierMetadata:
        for new in out.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            self._running += not st.scheduled
            st.scheduled = True
            log.debug("kvtier: %s scheduled with %d computed tokens", new.req_id,
                      new.num_computed_tokens)
            local = new.num_computed_tokens // self.chunk
            # A failed load truncated num_computed_tokens: re-save what gets recomputed.
            st.saved_upto = local if st.loaded_upto is None else min(st.loaded_upto, local)
            self._plan_save(st, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            else:
                if new_ids:
                    st.block_ids.extend(new_ids[0])
                if st.loaded_upto is not None and computed < st.saved_upto * self.chunk:
                    # A synchronous load failed: vLLM truncated the request at its first bad
                    # block and recomputes from there; save what it recomputes.
                    st.saved_upto = computed // self.chunk
            self._plan_save(st, computed + out.num_scheduled_tokens[req_id])
        meta = KVTierMetadata(self._loads, self._saves, self._hold, self._events)
        self._loads, self._saves, self._hold, self._events = [], [], [], []
        return meta

    def has_pending_push_work(self) -> bool:
        """Events not yet handed to the workers: the engine must step once more (a turn that
        ends the engine's last request would otherwise never reach the mover)."""
        return bool(self._events)

    def _forward_lookup(self, st: _Req, keys: list[str], hits: int, held: int) -> None:
        """Queue a lookup for the workers' stores. vLLM asks again every step for a request
        it cannot place yet: the same answer is sent again only to renew its pins."""
        now = time.monotonic()
        last = st.forwarded
        if last and last[:3] == (len(keys), hits, held) and now - last[3] < PIN_RENEW_S:
            return
        st.forwarded = (len(keys), hits, held, now)
        self._events.append(StoreEvent("lookup", keys, hits, held, st.hint))

    def _plan_save(self, st: _Req, computed: int, block_ids: list[int] | None = None) -> bool:
        """Save the chunks whose KV is complete at `computed` tokens and whose ids are known;
        True if a job was added."""
        done = min(computed, st.request.num_tokens) // self.chunk
        ids = st.block_ids if block_ids is None else block_ids
        done = min(done, len(ids) // self.m)
        if done <= st.saved_upto:
            return False
        keys = self._keys(st, done)
        rows = [ids[c * self.m:(c + 1) * self.m] for c in range(st.saved_upto, done)]
        self._saves.append(SaveJob(st.request.request_id, keys[st.saved_upto:done], rows,
                                   st.hint))
        st.saved_chunks += done - st.saved_upto
        st.saved_upto = done
        return True

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(keep the blocks?, `{"kvtier": {"hit_tokens": {tier: n}, "saved_chunks": n,
        "loads": {"async": n, "sync": n}}}`): `loads` counts the request's loads from kvtier
        by how they ran (more than one after a preemption).

        Chunks saved in earlier steps were gathered in those steps, before the blocks could
        be freed (on CUDA: queued on the compute stream before any later write), so they need
        no hold. Only chunks whose token ids became known at the end (async scheduling, spec
        decode) are saved now, from blocks the scheduler must keep until the worker has
        gathered them and reports the request in `finished_sending`.
        """
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._running -= st.scheduled
        # never scheduled (aborted while loading): its blocks hold nothing to save
        hold = st.scheduled and self._plan_save(st, request.num_computed_tokens,
                                                list(block_ids))
        hint = replace(st.hint or SessionHint(), gap_class=gap_class(request, self.tool_call_ids))
        if st.looked_up and self.forward:
            self._events.append(StoreEvent("finish", st.looked_up, hint=hint))
        elif st.looked_up:  # the store knows the request by the keys it looked up
            try:
                self.store.finish(st.looked_up, hint)
            except KVTierError as e:
                log.warning("kvtier: session bookkeeping failed for %s: %s",
                            request.request_id, e)
        if hold:
            log.debug("kvtier: %s ended with chunks left to save; holding its blocks",
                      request.request_id)
            self._hold.append(request.request_id)
        return hold, {"kvtier": {"hit_tokens": dict(st.tier_tokens),
                                 "saved_chunks": st.saved_chunks, "loads": dict(st.loads)}}

    def get_stats(self) -> KVTierStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        if self.store is not None:
            storeref.release(self.store)
            self.store = None
