"""What an engine replay sends: a workload turned into sessions of requests with real tokens.

A `Plan` is built from one `Workload` (`tools.workload.traces`, `tools.workload.synthetic`) and
fixes, per request: its session (plan-local, dense), its turn number, when it may be sent, the
chain of its full blocks (one plan block = `block_tokens` real tokens = one kvtier chunk), its
partial tail, and how many tokens the engine generates.

Timing contract (what the drivers implement):
- a request of a known session is sent `think_s` (scaled by `--speed`) after the response
  to the previous request of its session ended: agents wait for the answer, so a slow server
  delays the whole session (closed loop). `think_s` is the trace's wait between the previous
  response's end (arrival + recorded service time) and this arrival, never negative. A
  session's first request is sent at its trace arrival;
- a request of a trace without sessions (the conversation trace) is sent at its arrival
  (open loop).

Tokens: block id `b` is always the same `block_tokens` token ids (seeded by `seed` and `b`),
so equal chains are equal token prefixes and the engine's prefix hashing sees exactly the
sharing of the trace; tails are unique per request. Scaling keeps the shape: a trace block
of `B` tokens becomes `block_tokens` real tokens (`scale = block_tokens / B`), input and
output counts scale alike; prompts longer than `max_context` keep their head (prefixes stay
shared). Generated tokens are `min(scaled output, max_output)`; the next turn's prompt
carries the trace's own output tokens (fresh blocks, as the policy-only replay counts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvtier.store.base.keys import id_chain_hashes, make_keys
from kvtier.tools.workload.traces import TraceError, Workload

VOCAB = 2048  # the tiny model's vocabulary (tools.vllm_engine.TINY_MODEL)


@dataclass(frozen=True)
class PlanSpec:
    block_tokens: int = 32        # real tokens per plan block (= kvtier chunk_tokens)
    max_context: int = 16_384     # longest prompt sent (head kept)
    max_output: int = 32          # most tokens generated per request
    turns: int | None = None      # keep at most this many requests per session
    seed: int = 0


@dataclass
class Plan:
    name: str
    block_tokens: int
    scale: float                  # real tokens per trace token
    session: np.ndarray           # int64 plan session (dense; -1: open loop)
    turn: np.ndarray              # int64 turn number within the session
    arrival_s: np.ndarray         # float64 trace arrival
    think_s: np.ndarray           # float64 wait after the previous response (closed loop)
    input_tokens: np.ndarray      # int64 prompt length sent
    output_tokens: np.ndarray     # int64 tokens generated
    blocks: np.ndarray            # int64 flat chains of full blocks
    offsets: np.ndarray           # int64, len + 1
    next_in_session: np.ndarray   # int64 next request of the same session, -1 if none
    seed: int = 0

    def __len__(self) -> int:
        return len(self.session)

    def chain(self, i: int) -> np.ndarray:
        return self.blocks[self.offsets[i]:self.offsets[i + 1]]

    @property
    def sessions(self) -> int:
        return int(self.session.max()) + 1 if len(self) and self.session.max() >= 0 else 0

    @property
    def unique_blocks(self) -> int:
        return int(np.unique(self.blocks).size)

    def first_requests(self) -> list[int]:
        """Requests sent at their trace arrival: each session's first, and open-loop ones."""
        seen: set[int] = set()
        out = []
        for i in np.argsort(self.arrival_s, kind="stable"):
            s = int(self.session[i])
            if s < 0 or s not in seen:
                out.append(int(i))
                seen.add(s)
        return out

    def prompt(self, i: int) -> list[int]:
        """The token ids of request `i` (full blocks, then its own tail)."""
        parts = [_block_tokens(self.seed, int(b), self.block_tokens) for b in self.chain(i)]
        tail = int(self.input_tokens[i]) - len(parts) * self.block_tokens
        if tail > 0:
            rng = np.random.default_rng([self.seed, 1 << 40, i])
            parts.append(rng.integers(1, VOCAB, tail))
        return np.concatenate(parts).tolist() if parts else []

    def keys(self, i: int, ns_fingerprint: str) -> list[str]:
        """Block keys of request `i` for the simulated engine (chained over block ids)."""
        return make_keys(ns_fingerprint, _chain_hashes(self.seed, tuple(self.chain(i))))

    def reuse_bound(self) -> float:
        """% of input tokens an infinite cache could serve: each request's leading blocks
        that an earlier request (by arrival) already had. The rest is seen for the first
        time, and no cache hits it; a short run's first turns are a large share of it."""
        seen: set[int] = set()
        hit = 0
        for i in np.argsort(self.arrival_s, kind="stable"):
            chain = self.chain(int(i))
            lead = 0
            while lead < len(chain) and int(chain[lead]) in seen:
                lead += 1
            hit += lead * self.block_tokens
            seen.update(int(b) for b in chain)
        total = int(self.input_tokens.sum())
        return 100.0 * hit / total if total else 0.0

    def context_tokens(self) -> int:
        """Tokens of every distinct block: what an infinite cache ends up holding."""
        return self.unique_blocks * self.block_tokens


@lru_cache(maxsize=1 << 16)
def _block_tokens(seed: int, block_id: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, block_id]).integers(1, VOCAB, n)


@lru_cache(maxsize=4096)
def _chain_hashes(seed: int, ids: tuple) -> list[bytes]:
    return id_chain_hashes(ids, salt=str(seed).encode())


def make_plan(work: Workload, spec: PlanSpec, scale: float | None = None) -> Plan:
    """Turn `work` into a plan (see the module docstring); `scale` defaults to
    `spec.block_tokens / work.block_tokens` (one trace block = one plan block)."""
    bt = spec.block_tokens
    if bt < 1 or spec.max_context < 2 * bt or spec.max_output < 1:
        raise TraceError(f"plan: need block_tokens >= 1, max_context >= 2 blocks and "
                         f"max_output >= 1, got {spec}")
    eff = bt / work.block_tokens if scale is None else scale
    keep = _kept(work, spec.turns)
    max_blocks = spec.max_context // bt
    sess, turn, arr, think, inp, out, chains = [], [], [], [], [], [], []
    last_end: dict[int, float] = {}
    counts: dict[int, int] = {}
    dense: dict[int, int] = {}
    for i in keep:
        s = int(work.session[i])
        chain = work.chain(i)[:max_blocks]
        n_in = min(int(round(work.input_tokens[i] * eff)), spec.max_context)
        n_in = max(n_in, len(chain) * bt + 1)  # at least one token beyond the full blocks
        if len(chain) == max_blocks:
            n_in = len(chain) * bt  # truncated: no tail past the kept head
        ps = dense.setdefault(s, len(dense)) if s >= 0 else -1
        t = float(work.arrival_s[i])
        think.append(max(0.0, t - last_end[s]) if s in last_end else 0.0)
        last_end[s] = t + float(work.service_s[i])
        turn.append(counts.get(s, 0))
        counts[s] = counts.get(s, 0) + 1
        sess.append(ps)
        arr.append(t)
        inp.append(n_in)
        out.append(max(1, min(spec.max_output, int(math.ceil(work.output_tokens[i] * eff)))))
        chains.append(chain)
    return _assemble(work.name, bt, eff, spec.seed, sess, turn, arr, think, inp, out, chains)


def _kept(work: Workload, turns: int | None) -> list[int]:
    """Request indices in arrival order, at most `turns` per known session."""
    order = np.argsort(work.arrival_s, kind="stable")
    if turns is None:
        return [int(i) for i in order]
    seen: dict[int, int] = {}
    out = []
    for i in order:
        s = int(work.session[i])
        if s >= 0:
            seen[s] = seen.get(s, 0) + 1
            if seen[s] > turns:
                continue
        out.append(int(i))
    return out


def _assemble(name, bt, eff, seed, sess, turn, arr, think, inp, out, chains) -> Plan:
    if not sess:
        raise TraceError(f"{name}: no requests left to replay (check --sessions/--turns)")
    lengths = np.fromiter((len(c) for c in chains), dtype=np.int64, count=len(chains))
    offsets = np.zeros(len(chains) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    session = np.array(sess, dtype=np.int64)
    nxt = np.full(len(sess), -1, dtype=np.int64)
    last: dict[int, int] = {}
    for i, s in enumerate(sess):  # rows are in arrival order
        if s >= 0:
            if s in last:
                nxt[last[s]] = i
            last[s] = i
    flat = np.concatenate(chains).astype(np.int64) if chains else np.zeros(0, np.int64)
    return Plan(name, bt, eff, session, np.array(turn, dtype=np.int64),
                np.array(arr, dtype=np.float64), np.array(think, dtype=np.float64),
                np.array(inp, dtype=np.int64), np.array(out, dtype=np.int64), flat, offsets,
                nxt, seed)
