"""Scheduler side: which chunks of a request to load from kvtier and which to save.

- `get_num_new_matched_tokens`: keys for the request's full chunks (leaving at least one
  token to compute), one batched `store.lookup` of the whole chain (the store attaches the
  request to its session by it; only the chunks past vLLM's local hit are looked for in the
  tiers), and the part of the hit beyond vLLM's local hit. The lookup runs off the
  scheduler's thread (`connector.plan.lookups`): one that does not answer within a few
  milliseconds is answered None (vLLM asks again next step), and one that has not answered
  when waiting has cost what recomputing the request would (at least that inline wait) is
  given up and the request computed, so a tier that hangs never stalls the engine's other
  requests. The hit is in whole chunks; a chunk that starts inside the local hit is loaded
  without overwriting the local blocks. The load is asynchronous, or synchronous (done
  before the forward of the step that schedules the request) by the connector's `load`
  setting; `auto` loads synchronously when no other request of the engine is running
  (nothing for the load to overlap with).
- The hit is planned before it is promised (`connector.plan.recompute`): only the prefix whose
  load beats recomputing it is loaded (from the tiers' measured read rates and the engine's
  own prefill cost, learned from its steps), with a deadline past which what has not
  arrived is recomputed; a request whose load failed is not promised a hit again.
- `update_state_after_alloc`: turns the hit into a `LoadJob` over the allocated blocks.
- `build_connector_meta`: tracks every scheduled request's block ids, and emits a `SaveJob`
  for each chunk whose KV is complete after this step and not known to be in kvtier
  (chunks loaded from kvtier or covered by a local hit are not saved again).
- `update_connector_output`: the workers say how much of each load job landed; only that
  counts as hit tokens (`hit_tokens:<tier>`, the response's `hit_tokens`), the rest as
  `recomputed_tokens`.
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

Several KV cache groups (vLLM's hybrid memory allocator, `SupportsHMA`): the first group
that holds every token (full attention or MLA) is the *primary* one, and everything above
is about its chunks. Each other group stores and loads the same chunks under its own keys
(`naming`), each from its own block ids. A sliding-window group needs only the chunks the
window of a hit's last token reaches: a hit of `h` chunks is promised only when that group
holds the chunks over the `window` tokens before `h * chunk_tokens` (else only vLLM's local
hit is used), it loads only those, and it saves only the chunks of a request that such a
window can reach at the end of its prompt or later (where the next turn's hit ends) or
from an end where its lookup found the full group's chunks but no window (a fork from the
middle of an earlier prompt: the next prompt forking there hits), from blocks vLLM still
holds. Loads are then asynchronous only (vLLM takes load failures of such
engines per request, not per block): a load that falls short in any group recomputes the
request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector import storeref
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.plan.lookups import PENDING, LookupGaveUp, Lookups
from kvtier.connector.metadata import KVTierMetadata, LoadJob, SaveJob, StoreEvent
from kvtier.connector.naming import (architecture, kv_groups, make_namespace, primary,
                                     rank_keys, request_salt, session_hint, token_keys)
from kvtier.connector.plan.recompute import RecomputeModel, plan_load
from kvtier.connector.stats import KVTierStats
from kvtier.connector.tool_calls import detect_tool_call_ids, gap_class
from kvtier.store.base.block import HEADER_SIZE
from kvtier.store.base.errors import KVTierError
from kvtier.store.base.keys import end_keys
from kvtier.store.placement import PIN_S
from kvtier.store.tiered import SessionHint

log = logging.getLogger(__name__)
SHARE_EVERY_S = 1.0  # how often an engine without prefills looks for the node's model
PUBLISH_EVERY_S = 10.0  # how often an engine republishes its own (each an index write)
# A request vLLM keeps asking about renews its pins in the workers' stores this often (they
# last `PIN_S` there).
PIN_RENEW_S = PIN_S / 3

# The id vLLM's block pool gives its null block: the place-holder of a sliding-window group's
# blocks that no attention reads any more (vLLM allocates it first, so it is always 0).
NULL_BLOCK = 0

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
    deadline_s: float | None = None
    grace_s: float = 0.0         # the least time the load gets from its start (`LoadPlan`)
    tail: int = 0                # recurrent models: tokens of the hit past its chunks
    end_key: str | None = None   # recurrent models: the key of the hit's end (`_state_end`)
    end_tier: str | None = None  # where the end's frames were found (a hint for the load)


@dataclass
class _Req:
    request: Any
    salt: bytes
    hint: SessionHint | None
    keys: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)   # of the primary group
    group_ids: dict[int, list[int]] = field(default_factory=dict)  # of each other group
    saved_upto: int = 0          # chunks [0, saved_upto) are in kvtier or handed to a save
    loaded_upto: int | None = None
    plan: _Plan | None = None
    sources: dict[CacheHitSource, int] = field(default_factory=dict)
    tier_tokens: dict[str, int] = field(default_factory=dict)   # loaded, by tier
    promises: list[list[tuple[str, int]]] = field(default_factory=list)  # per job: (tier,
    # tokens) per chunk, until the workers say how much of it landed
    recomputed: int = 0          # tokens promised from kvtier, then recomputed
    declined: int = 0            # tokens found in kvtier, recomputed as faster (last lookup)
    deadlines_ms: list[float] = field(default_factory=list)  # of its loads, as planned
    load_failed: bool = False    # a load fell short: recompute, do not promise again
    looked_up: list[str] = field(default_factory=list)  # the keys of the last lookup
    window_ends: set[int] = field(default_factory=set)  # hit ends a lookup found no window at
    ends: set[int] = field(default_factory=set)  # recurrent models: positions a state is saved at
    saved_chunks: int = 0
    loads: dict[str, int] = field(default_factory=lambda: {"async": 0, "sync": 0})
    scheduled: bool = False      # its blocks hold computed (or loaded) KV
    forwarded: tuple = ()        # (chunks, hits, held, when) of the last lookup forwarded


class SchedulerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig):
        groups = kv_groups(kv_cache_config, architecture(vllm_config))
        self.shape = primary(groups)
        self.ns = make_namespace(vllm_config, self.shape, cfg.policy)
        # the other groups: (shape, its namespace fingerprint at rank 0)
        named = [(g, make_namespace(vllm_config, g, cfg.policy).fingerprint())
                 for g in groups if g is not self.shape]
        self.others = [(g, fp) for g, fp in named if not g.stateful]
        self.states = [(g, fp) for g, fp in named if g.stateful]  # recurrent groups
        self.fp = self.ns.fingerprint()
        # With speculative decoding a decode step's state depends on how many drafts were
        # accepted: recurrent states are then saved at prompt ends only.
        self.decode_ends = getattr(vllm_config, "speculative_config", None) is None
        self.chunk = cfg.policy.chunk_tokens
        self.m = self.chunk // self.shape.block_size
        self.tier_kinds = {t.name: t.kind for t in cfg.policy.tiers}
        self.load_mode = cfg.load
        par = vllm_config.parallel_config
        self.world = par.tensor_parallel_size * par.pipeline_parallel_size
        self.frame_bytes = HEADER_SIZE + self.m * self.shape.block_bytes
        self.deadlines = cfg.load_deadline
        self.budget = vllm_config.scheduler_config.max_num_batched_tokens
        self.recompute = RecomputeModel(cfg.prefill_tokens_per_s, self.budget)
        # engines whose prefill costs are alike: one model, layout and parallelism
        self._prefill_kind = f"{self.fp}/{self.world}"
        self._prefill_shared = -SHARE_EVERY_S  # when the node's prefill model was last read
        # when this engine's was last written (None: never)
        self._prefill_published: float | None = None
        self._settling: dict[str, dict[int, int]] = {}  # request -> rank -> chunks loaded
        self.tool_call_ids = detect_tool_call_ids(vllm_config.model_config) \
            if cfg.tool_call_token_ids == "auto" else frozenset(cfg.tool_call_token_ids)
        self._running = 0  # requests scheduled and not finished (for `load: auto`)
        self.store = storeref.acquire(cfg.policy, cfg.node_id, mover=False)
        self._step_ended = lambda: storeref.step_ended(cfg.policy, cfg.node_id)
        # The worker side is built first in a shared process (storeref): a store without a
        # mover means the workers, and the stores that act on sessions, are elsewhere.
        self.forward = not self.store.runs_mover
        self._events: list[StoreEvent] = []
        self.reqs: dict[str, _Req] = {}
        self.lookups = Lookups()
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

    def get_num_new_matched_tokens(self, request: Any, num_computed: int
                                   ) -> tuple[int | None, bool]:
        st = self._state(request)
        limit = (request.num_tokens - 1) // self.chunk  # keep >= 1 token to compute
        if st is None or limit == 0:
            return 0, False
        # The whole chain from the first chunk, also when vLLM holds a prefix locally: the
        # store attaches the request to its session by it, and touches what is held. Only
        # the chunks past the local hit are looked for in the tiers.
        keys = self._keys(st, limit)
        first = num_computed // self.chunk
        held = min(first, limit)
        t0 = time.perf_counter()
        def budget() -> float:  # asked once per lookup: a prediction is not free
            # Waiting longer for the answer than recomputing what it could save is a loss;
            # but never less than the inline wait, in which a healthy lookup answers (it also
            # ties the request to its session, which a prompt held locally still needs).
            if not self.deadlines:
                return float("inf")
            return max(self.lookups.inline_s, self.recompute.predict(
                (limit - held) * self.chunk, held * self.chunk))

        try:
            found = self.lookups.answer(
                request.request_id, (limit, held),
                lambda: self.store.lookup(keys, st.hint, held=held, observe=False), budget)
        except LookupGaveUp as e:
            log.warning("kvtier: lookup gave up, computing request %s: %s",
                        request.request_id, e)
            self.stats.add("lookups_given_up")
            return 0, False
        except KVTierError as e:
            log.warning("kvtier: lookup failed, serving request %s without it: %s",
                        request.request_id, e)
            return 0, False
        if found is PENDING:
            return None, False
        st.looked_up = keys
        if self.forward:
            self._forward_lookup(st, keys, found.hit_blocks, held)
        else:
            try:
                self.store.observe_lookup(keys, found.hit_blocks, st.hint, held)
            except KVTierError as e:
                log.warning("kvtier: session bookkeeping failed for %s: %s",
                            request.request_id, e)
        log.debug("kvtier: lookup %s: %d of %d chunks (%d held locally) in %.2f ms",
                  request.request_id, found.hit_blocks, limit, held,
                  (time.perf_counter() - t0) * 1e3)
        self.stats.add("lookups")
        self.stats.add("lookup_tokens", max(0, limit * self.chunk - num_computed))
        hits, deadline, grace = self._plan(st, found, first)
        hits = self._others_hold(st, keys, first, hits)
        tail, end_key, end_tier = 0, None, None
        if self.states:
            if num_computed or st.load_failed or hits < found.hit_blocks and self.deadlines:
                hits = 0  # a state is only where it was stored: all of the hit or none
            else:
                hits, tail, end_key, end_tier = self._state_end(st, hits)
        external = hits * self.chunk + tail - num_computed
        if external <= 0:
            st.plan = None
            return 0, False
        sync = self._load_sync(st)
        st.plan = _Plan(num_computed, first, hits - first, found.tiers[first:hits], sync,
                        deadline, grace, tail, end_key, end_tier)
        return external, not sync

    def _end_key(self, st: _Req, pos: int) -> str:
        """The end key of `st`'s tokens [0, pos) (primary namespace)."""
        c = pos // self.chunk
        keys = self._keys(st, c)
        tokens = st.request.all_token_ids[c * self.chunk:pos]
        return end_keys(self.fp, tokens, st.salt, keys[c - 1] if c else None)[-1]

    def _state_end(self, st: _Req, hits: int) -> tuple[int, int, str | None, str | None]:
        """(chunks, tail tokens, end key, tier) of the furthest position a hit on a
        recurrent model can end at: at most the `hits` chunks found, plus the part of the
        next chunk, where every recurrent group's state and every attention group's
        part-chunk before it are stored; (0, 0, None, None) where none is.

        States are stored where a step ended computing a request: a prompt's end and a
        request's, which the next turn extends (the chunks before them are stored, the one
        they end in is not), and the ends of the prefill steps of a long prompt, at
        multiples of the engine's token budget. So an end is looked for at every token of
        the chunk past the found ones and at those multiples below: the recurrent groups'
        states first, then the part-chunks of the positions that have them (a second, small
        ask: the tiers are asked about each key, a file tier with a stat each)."""
        req, C = st.request, self.chunk
        last = req.num_tokens - 1  # vLLM computes at least the last token
        n = min(C - 1, last - hits * C)
        ks = end_keys(self.fp, req.all_token_ids[hits * C:hits * C + n], st.salt,
                      st.keys[hits - 1] if hits else None) if n >= 0 else []
        cands = [(hits * C + t, k) for t, k in enumerate(ks)][::-1]  # furthest first
        step = self.budget
        cands += [(p, self._end_key(st, p))
                  for p in range((hits * C - 1) // step * step, 0, -step) if p % C == 0]
        cands = [(p, k) for p, k in cands if 0 < p <= last]
        if not cands:
            return 0, 0, None, None
        try:
            have = self._where([k for _, k in cands], [fp for _, fp in self.states])
            have = [(p, k, tier) for (p, k), tier in zip(cands, have) if tier]
            tails = self._where([k for p, k, _ in have if p % C],
                                [self.fp] + [fp for _, fp in self.others])
        except KVTierError as e:
            log.warning("kvtier: lookup of recurrent states failed: %s", e)
            return 0, 0, None, None
        tail_tiers = iter(tails)  # one per position of `have` inside a chunk, in order
        for pos, key, tier in have:
            if pos % C:
                tier = next(tail_tiers)
            if tier:
                return pos // C, pos % C, key, tier
        return 0, 0, None, None

    def _where(self, keys: list[str], fps: list[str]) -> list[str | None]:
        """Per key of `keys`: a tier holding it in every namespace of `fps` (the slowest
        one's answer), or None."""
        if not keys:
            return []
        where = self.store.where([k for fp in fps for k in rank_keys(keys, fp)])
        n = len(keys)
        return [None if not all(where[j * n + i] for j in range(len(fps)))
                else where[(len(fps) - 1) * n + i] for i in range(n)]

    def _plan(self, st: _Req, found: Any, first: int) -> tuple[int, float | None, float]:
        """(chunks of the chain to count as hit, the load's deadline, its grace): the prefix
        of the hit past the local one whose load beats recomputing it (`plan_load`)."""
        st.declined = 0
        if st.load_failed or found.hit_blocks <= first:
            return first, None, 0.0
        if not self.deadlines:
            return found.hit_blocks, None, 0.0
        # An engine idle since its last step has not read the node's model since: a first
        # hit after a cold elsewhere would be planned with the slow prior.
        self._share_prefill()
        plan = plan_load(found.tiers[first:found.hit_blocks], self.chunk, first * self.chunk,
                         lambda ts: self.store.expected_load_s(ts, self.frame_bytes),
                         self.recompute)
        st.declined = (found.hit_blocks - first - plan.chunks) * self.chunk
        if plan.chunks < found.hit_blocks - first:
            log.debug("kvtier: %s: loading %d of %d hit chunks (load %.1f ms against "
                      "recompute %.1f ms)", st.request.request_id, plan.chunks,
                      found.hit_blocks - first, plan.expected_s * 1e3, plan.recompute_s * 1e3)
        return first + plan.chunks, plan.deadline_s, plan.grace_s

    def _rows(self, ids: list[int], chunks: Any) -> list[list[int]]:
        """The block ids of each of `chunks` (chunk indices) in one group's `ids`."""
        m = self.m
        return [ids[c * m:(c + 1) * m] for c in chunks]

    def _span(self, shape: Any, first: int, hits: int) -> int:
        """The first chunk of [first, hits) that group `shape` loads: all of them, or for a
        sliding-window group those its window reaches from the hit's end."""
        if not shape.windowed:
            return first
        return max(first, max(0, hits * self.chunk - shape.window) // self.chunk)

    def _others_hold(self, st: _Req, keys: list[str], first: int, hits: int) -> int:
        """`hits`, cut to what the other groups hold: every chunk of a full group's part of
        the hit, a sliding-window group's window before the hit's end (or no hit at all).

        A missing window is where this prompt forks from one stored before (after a shared
        system prompt, a sub-agent's task, an edited turn): the request then saves the
        window before that end as it computes it, so the next prompt that forks there
        hits."""
        for shape, fp in self.others:
            if hits <= first:
                break
            lo = self._span(shape, first, hits)
            try:
                have = self.store.lookup(rank_keys(keys[lo:hits], fp), observe=False).hit_blocks
            except KVTierError as e:
                log.warning("kvtier: lookup of KV cache group %d failed: %s", shape.group, e)
                return first
            if lo + have < hits:
                if shape.windowed:
                    st.window_ends.add(hits)
                    return first
                hits = lo + have
        return hits

    def _load_sync(self, st: _Req) -> bool:
        if self.others:  # vLLM takes such engines' load failures per request: async only
            return False
        if self.load_mode != "auto":
            return self.load_mode == "sync"
        return self._running == 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None or num_external == 0 or st.plan is None:
            return
        plan, st.plan = st.plan, None
        all_ids = blocks.get_block_ids()
        ids = all_ids[self.shape.group]
        n = min(plan.hits, -(-(plan.num_computed + num_external) // self.chunk) - plan.first)
        rows = self._rows(ids, range(plan.first, plan.first + n))
        skip = plan.num_computed // self.shape.block_size - plan.first * self.m
        job = LoadJob(request.request_id, st.keys[plan.first:plan.first + n], rows, skip,
                      list(plan.tiers[:n]), plan.sync, plan.deadline_s, self.shape.group,
                      plan.grace_s)
        self._loads.append(self._with_tail(job, plan, ids, self.fp))
        for shape, fp in self.others:
            job = self._group_load(st, shape, fp, all_ids[shape.group], plan, n)
            if job is not None or plan.tail:
                job = job or LoadJob(request.request_id, [], [], 0, [], plan.sync,
                                     plan.deadline_s, shape.group, plan.grace_s)
                self._loads.append(self._with_tail(job, plan, all_ids[shape.group], fp))
        for shape, fp in self.states:
            self._loads.append(LoadJob(request.request_id, rank_keys([plan.end_key], fp),
                                       [all_ids[shape.group][:1]], 0, [plan.end_tier],
                                       plan.sync, plan.deadline_s, shape.group,
                                       plan.grace_s))
        st.loads["sync" if plan.sync else "async"] += 1
        st.loaded_upto = st.saved_upto = plan.first + n
        if plan.deadline_s is not None:
            st.deadlines_ms.append(round(plan.deadline_s * 1e3, 1))
        promise = self._promise(plan, n, num_external)
        st.promises.append(promise)
        st.sources = self._sources(promise)

    def _tail_row(self, ids: list[int], pos: int) -> list[int]:
        """The blocks of one group's part-chunk before `pos` (a recurrent model's hit end),
        as a chunk's row: the blocks past `pos` are vLLM's null block, never read; [] if
        `ids` do not reach `pos` (vLLM allocates a hit's blocks before it is loaded, so
        only a save can meet that)."""
        c, k = pos // self.chunk, -(-(pos % self.chunk) // self.shape.block_size)
        row = ids[c * self.m:c * self.m + k]
        return row + [NULL_BLOCK] * (self.m - k) if len(row) == k else []

    def _with_tail(self, job: LoadJob, plan: _Plan, ids: list[int], fp: str) -> LoadJob:
        """`job` with the part-chunk of the hit's end appended (recurrent models)."""
        if not plan.tail:
            return job
        pos = (plan.first + plan.hits) * self.chunk + plan.tail
        return replace(job, keys=job.keys + rank_keys([plan.end_key], fp),
                       block_ids=job.block_ids + [self._tail_row(ids, pos)],
                       tiers=(job.tiers + [plan.end_tier]) if job.tiers else [])

    def _group_load(self, st: _Req, shape: Any, fp: str, ids: list[int], plan: _Plan,
                    n: int) -> LoadJob | None:
        """The load of another group's part of the hit: its span of chunks (`_span`), less
        the leading blocks vLLM holds (a local hit) or will never read (null blocks)."""
        end = plan.first + n
        lo = self._span(shape, plan.first, end)
        m = self.m
        rows = self._rows(ids, range(lo, end))
        while rows and all(b == NULL_BLOCK for b in rows[0]):
            rows.pop(0)
            lo += 1
        if not rows:
            return None
        local = plan.num_computed // self.shape.block_size - lo * m if lo == plan.first else 0
        nulls = next((j for j, b in enumerate(rows[0]) if b != NULL_BLOCK), m)
        return LoadJob(st.request.request_id, rank_keys(st.keys[lo:end], fp), rows,
                       max(local, nulls), [], plan.sync, plan.deadline_s, shape.group,
                       plan.grace_s)

    def _promise(self, plan: _Plan, n: int, num_external: int) -> list[tuple[str, int]]:
        """(tier, tokens) of each chunk of the load: the first starts inside the local hit;
        a recurrent model's part-chunk last."""
        out, left = [], num_external
        for c, tier in enumerate(plan.tiers[:n]):
            tokens = min(left, self.chunk - (plan.num_computed % self.chunk if c == 0 else 0))
            left -= tokens
            out.append((tier, tokens))
        if plan.tail:
            out.append((plan.end_tier, left))
        return out

    def _sources(self, promise: list[tuple[str, int]]) -> dict[CacheHitSource, int]:
        """Tokens promised per vLLM cache-hit source (vLLM's own hit metrics)."""
        out: dict[CacheHitSource, int] = {}
        for tier, tokens in promise:
            src = _HIT_SOURCE.get(self.tier_kinds.get(tier, ""),
                                  CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + tokens
        return {k: v for k, v in out.items() if v}

    def update_connector_output(self, output: Any) -> None:
        """Learn from the forwards the workers timed, and count what they loaded: a job's
        chunks once every rank has reported."""
        meta = getattr(output, "kv_connector_worker_meta", None)
        for tokens, attn, seconds in getattr(meta, "steps", ()):
            self.recompute.observe(tokens, attn, seconds)
        self._share_prefill()
        for req_id, rank, chunks in getattr(meta, "settled", ()):
            ranks = self._settling.setdefault(req_id, {})
            ranks[rank] = chunks
            if len(ranks) < self.world:
                continue
            del self._settling[req_id]
            st = self.reqs.get(req_id)
            if st is not None and st.promises:
                self._settle(st, min(ranks.values()))
        self._step_ended()  # a worker side in this process may start its saves

    def _share_prefill(self) -> None:
        """Publish this engine's prefill model as soon as it has timed prefills (then every
        `PUBLISH_EVERY_S`), and until then take the node's every `SHARE_EVERY_S`
        (`RecomputeModel.adopt`), at a step or before planning a hit."""
        now = time.monotonic()
        if now - self._prefill_shared < SHARE_EVERY_S and (
                self._prefill_published is not None or not self.recompute.shareable):
            return
        self._prefill_shared = now
        try:
            mine = self.recompute.summary()
            if mine is not None:
                last = self._prefill_published
                if last is None or now - last >= PUBLISH_EVERY_S:
                    self.store.publish_prefill(self._prefill_kind, mine)
                    self._prefill_published = now
            elif self.recompute.adopt(self.store.node_prefill(self._prefill_kind)):
                log.info("kvtier: prefill cost taken from this node's engines of the same "
                         "model until this one has timed its own: %d tokens recompute in "
                         "%.2f s", self.budget, self.recompute.predict(self.budget))
        except KVTierError as e:  # the index is busy or gone: plan with what we have
            log.debug("kvtier: sharing the prefill model failed: %s", e)

    def _settle(self, st: _Req, loaded: int) -> None:
        """The oldest load job of `st` landed its first `loaded` chunks: those are hits, the
        rest was promised and recomputed."""
        promise = st.promises.pop(0)
        for tier, tokens in promise[:loaded]:
            self.stats.add(f"hit_tokens:{tier}", tokens)
            st.tier_tokens[tier] = st.tier_tokens.get(tier, 0) + tokens
        lost = sum(tokens for _, tokens in promise[loaded:])
        if lost:
            self.stats.add("recomputed_tokens", lost)
            st.recomputed += lost
            st.load_failed = True

    def hit_sources(self, request: Any, num_external: int) -> dict[CacheHitSource, int]:
        st = self.reqs.get(request.request_id)
        if st is None or sum(st.sources.values()) != num_external:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external} if num_external else {}
        return dict(st.sources)

    # ---- per step: block tracking and saves ---------------------------------------------

    def build_connector_meta(self, out: Any) -> KVTierMetadata:
        work, prefill, continues = self._step_work(out)
        for new in out.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:
                continue
            self._set_ids(st, new.block_ids)
            self._running += not st.scheduled
            st.scheduled = True
            log.debug("kvtier: %s scheduled with %d computed tokens", new.req_id,
                      new.num_computed_tokens)
            local = new.num_computed_tokens // self.chunk
            # A failed load truncated num_computed_tokens: re-save what gets recomputed.
            st.saved_upto = local if st.loaded_upto is None else min(st.loaded_upto, local)
            pos = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
            self._plan_save(st, pos)
            self._save_end(st, pos)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                self._set_ids(st, new_ids)
            else:
                if new_ids:
                    st.block_ids.extend(new_ids[self.shape.group])
                    for shape, _ in self.others + self.states:
                        st.group_ids.setdefault(shape.group, []).extend(new_ids[shape.group])
                if st.loaded_upto is not None and computed < st.saved_upto * self.chunk:
                    # A synchronous load failed: vLLM truncated the request at its first bad
                    # block and recomputes from there; save what it recomputes.
                    st.saved_upto = computed // self.chunk
            n = out.num_scheduled_tokens[req_id]
            self._plan_save(st, computed + n)
            if self.states:
                last = st.request.num_output_tokens + n >= (st.request.max_tokens or 0) > 0
                self._save_end(st, computed + n, last=last)
        meta = KVTierMetadata(self._loads, self._saves, self._hold, self._events, work,
                              prefill=prefill, prefilling=continues)
        self._loads, self._saves, self._hold, self._events = [], [], [], []
        return meta

    def _set_ids(self, st: _Req, ids: Any) -> None:
        """The request's block ids, per group (`ids`: vLLM's tuple of lists, or None)."""
        st.block_ids = list(ids[self.shape.group]) if ids else []
        st.group_ids = {s.group: list(ids[s.group]) if ids else []
                        for s, _ in self.others + self.states}

    def _step_work(self, out: Any) -> tuple[tuple[float, float], bool, list[str]]:
        """What this step's forward computes, as `RecomputeModel` counts it; whether some
        request of it computes more than one token (a prefill); the requests left with
        prompt tokens to compute after this step."""
        work = [(out.num_scheduled_tokens.get(r.req_id, 0), r.num_computed_tokens, r.req_id)
                for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        work += [(out.num_scheduled_tokens.get(r, 0), c, r)
                 for r, c in zip(cached.req_ids, cached.num_computed_tokens)]
        continues = [req_id for n, c, req_id in work
                     if n > 1 and (st := self.reqs.get(req_id)) is not None
                     and c + n < st.request.num_prompt_tokens]
        return (RecomputeModel.step_features([(n, c) for n, c, _ in work]),
                any(n > 1 for n, _, _ in work), continues)

    def has_pending_push_work(self) -> bool:
        """Events or saves not yet handed to the workers: the engine must step once more (a
        turn that ends the engine's last request would otherwise never reach the mover, and
        what it saves at its end would wait for the next request)."""
        return bool(self._events or self._saves or self._hold)

    def _forward_lookup(self, st: _Req, keys: list[str], hits: int, held: int) -> None:
        """Queue a lookup for the workers' stores. vLLM asks again every step for a request
        it cannot place yet: the same answer is sent again only to renew its pins."""
        now = time.monotonic()
        last = st.forwarded
        if last and last[:3] == (len(keys), hits, held) and now - last[3] < PIN_RENEW_S:
            return
        st.forwarded = (len(keys), hits, held, now)
        self._events.append(StoreEvent("lookup", keys, hits, held, st.hint))

    def _plan_save(self, st: _Req, computed: int, block_ids: Any = None) -> bool:
        """Save the chunks whose KV is complete at `computed` tokens and whose ids are known
        (`block_ids`: vLLM's per-group lists, else the ones tracked); True if a job was
        added."""
        done = min(computed, st.request.num_tokens) // self.chunk
        ids = st.block_ids if block_ids is None else list(block_ids[self.shape.group])
        done = min(done, len(ids) // self.m)
        if done <= st.saved_upto:
            return False
        keys = self._keys(st, done)
        rows = self._rows(ids, range(st.saved_upto, done))
        self._saves.append(SaveJob(st.request.request_id, keys[st.saved_upto:done], rows,
                                   st.hint, self.shape.group))
        for shape, fp in self.others:
            group_ids = st.group_ids.get(shape.group, []) if block_ids is None \
                else list(block_ids[shape.group])
            self._group_save(st, shape, fp, group_ids, st.saved_upto, done)
        st.saved_chunks += done - st.saved_upto
        st.saved_upto = done
        return True

    def _save_end(self, st: _Req, pos: int, block_ids: Any = None, last: bool = False) -> bool:
        """Recurrent models: save what a hit ending at `pos` needs, where a step ended
        computing the request: a step that computes prompt tokens, or (`last`) its last
        step, known by its `max_tokens`, or its end (gathered in the next step), not every
        decoded token. That is each recurrent group's state, which vLLM keeps in the
        request's first block of that group, and inside a chunk each attention group's
        part-chunk before `pos`. True if a job was added."""
        req = st.request
        if not self.states or pos <= 0 or pos in st.ends or pos > len(req.all_token_ids) \
                or not (last and self.decode_ends or pos <= req.num_prompt_tokens):
            return False
        key = self._end_key(st, pos)
        states = [(g, fp, self._ids(st, g.group, block_ids)[:1]) for g, fp in self.states]
        tails = [(g, fp, self._tail_row(self._ids(st, g.group, block_ids), pos))
                 for g, fp in [(self.shape, self.fp)] + self.others] if pos % self.chunk else []
        if any(not row or row[0] == NULL_BLOCK for _, _, row in states + tails):
            return False  # the blocks are not there: nothing is stored at this end
        st.ends.add(pos)
        self._saves.extend(SaveJob(req.request_id, rank_keys([key], fp), [row], st.hint,
                                   g.group) for g, fp, row in states + tails)
        return True

    def _ids(self, st: _Req, group: int, block_ids: Any = None) -> list[int]:
        """One group's block ids of `st`: from vLLM's per-group lists, else the tracked."""
        if block_ids is not None:
            return list(block_ids[group])
        return st.block_ids if group == self.shape.group else st.group_ids.get(group, [])

    def _group_save(self, st: _Req, shape: Any, fp: str, ids: list[int], start: int,
                    done: int) -> None:
        """Save another group's part of chunks [start, done): of a sliding-window group only
        the chunks a window can reach from the end of the prompt on or from an end where a
        lookup found the window missing (`_others_hold`), and only while vLLM still holds
        their blocks."""
        reach = st.request.num_prompt_tokens - self.chunk - shape.window
        ends = [(self._span(shape, 0, e), e) for e in st.window_ends]
        chunks = [c for c in range(start, min(done, len(ids) // self.m))
                  if not shape.windowed or (c + 1) * self.chunk > reach
                  or any(lo <= c < e for lo, e in ends)]
        kept = [(c, row) for c, row in zip(chunks, self._rows(ids, chunks))
                if NULL_BLOCK not in row]
        if kept:
            self._saves.append(SaveJob(st.request.request_id,
                                       rank_keys([st.keys[c] for c, _ in kept], fp),
                                       [row for _, row in kept], st.hint, shape.group))

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict | None]:
        """(keep the blocks?, `{"kvtier": {"hit_tokens": {tier: n}, "recomputed_tokens": n,
        "declined_tokens": n, "load_deadlines_ms": [ms], "saved_chunks": n, "loads":
        {"async": n, "sync": n}}}`): `hit_tokens` counts the tokens loaded from each tier,
        `recomputed_tokens` those promised and then recomputed (a load that failed or passed
        its deadline), `declined_tokens` those found in kvtier and recomputed because
        loading them would have taken longer (never promised),
        `load_deadlines_ms` the deadline each of its loads was given, `loads` the request's
        loads from kvtier by how they ran (more than one after a preemption).

        Chunks saved in earlier steps were gathered in those steps, before the blocks could
        be freed (on CUDA: queued on the compute stream before any later write), so they need
        no hold. Only chunks whose token ids became known at the end (async scheduling, spec
        decode) are saved now, from blocks the scheduler must keep until the worker has
        gathered them and reports the request in `finished_sending`.
        """
        self.lookups.forget(request.request_id)
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._running -= st.scheduled
        self._settling.pop(request.request_id, None)
        while st.promises and st.scheduled:
            # A load not reported yet finished in this very step (a sync load): vLLM would
            # have rescheduled the request, not ended it, had any of its blocks failed. (One
            # never scheduled was aborted while loading: nothing of it counts.)
            self._settle(st, len(st.promises[0]))
        # never scheduled (aborted while loading): its blocks hold nothing to save
        hold = st.scheduled and self._plan_save(st, request.num_computed_tokens, block_ids)
        if st.scheduled and self._save_end(st, request.num_computed_tokens, block_ids, True):
            hold = True  # the state and part-chunk are gathered in the next step
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
        if st.declined:
            self.stats.add("declined_tokens", st.declined)
        return hold, {"kvtier": {"hit_tokens": dict(st.tier_tokens),
                                 "recomputed_tokens": st.recomputed,
                                 "declined_tokens": st.declined,
                                 "load_deadlines_ms": st.deadlines_ms,
                                 "saved_chunks": st.saved_chunks, "loads": dict(st.loads)}}

    def get_stats(self) -> KVTierStats | None:
        deferred = self.lookups.take_deferred()
        if deferred:
            self.stats.add("lookups_deferred", deferred)
        return self.stats.take()

    def shutdown(self) -> None:
        self.lookups.close()
        if self.store is not None:
            storeref.release(self.store)
            self.store = None
