"""Workloads whose shape differs from the three the policies were tuned on, seeded.

Their parameters are fixed here, before any policy was measured on them, and are never tuned
on (a policy that only does well where it was tuned is no production policy):
- `forks`: agent sessions that spawn sub-agents (a Claude Code `Task` tree): at some turns a
  parent forks 1-4 sub-agents from its current prefix; they run a few tool-call turns each, at
  once, and the parent's next turn comes after the last of them ends.
- `chat`: chat sessions with no agent loop: short (geometric, mean 4 turns), a small shared
  system prompt, a few hundred tokens a turn, human gaps (median 45 s, P99 15 min), session
  starts a Poisson process.
- `rag`: many short sessions that each put 1-3 of a few large documents (Zipf popularity)
  after a shared system prompt, then a question; beside them a few long agent sessions.
Each takes a `population`: that many times the sessions (and agents) over the same time, as
on a node serving more users (1: the workloads as fixed; the larger node a miniature
simulation samples from).
`retime(work, factor)` multiplies a workload's arrival times (the time-scale option: 0.1
compresses 10x, 10 stretches); service times stay, as an engine does not get faster.

Block ids are chained (`_Chains`): a block's id names its whole prefix, as in a store, so a
document after another is a different block than the same document first.
"""

from __future__ import annotations

import math

import numpy as np

from kvtier.tools.workload.traces import Workload, build

BLOCK_TOKENS = 256
PREFILL_TPS = 20_000.0   # the replay's default: a turn's own service time
_Z99 = 2.3263478740408408
_TOOL, _USER = 1, 2


def _lognormal(rng, median_s: float, p99_s: float) -> float:
    return float(rng.lognormal(math.log(median_s), math.log(p99_s / median_s) / _Z99))


class _Chains:
    """Block ids from block contents: (id of the block before, content) -> id."""

    def __init__(self):
        self._ids: dict[tuple, int] = {}

    def ids(self, contents: list) -> np.ndarray:
        out, prev = [], -1
        for c in contents:
            prev = self._ids.setdefault((prev, c), len(self._ids))
            out.append(prev)
        return np.array(out, dtype=np.int64)


def _request(rows, chains, ch: _Chains, t: float, contents: list, out_tokens: int,
             session: int, gap_class: int) -> float:
    """Append one request of `len(contents)` full blocks; return its service time."""
    n_in = len(contents) * BLOCK_TOKENS
    service = n_in / PREFILL_TPS + out_tokens / 50.0   # prefill, then ~50 tokens/s decode
    rows.append((t, n_in, out_tokens, session, gap_class, service))
    chains.append(ch.ids(contents))
    return service


def _blocks(tokens: int) -> int:
    return max(1, tokens // BLOCK_TOKENS)


def forks(seed: int = 0, parents: int = 24, turns: int = 16, population: int = 1) -> Workload:
    """Parent agents that fork sub-agents from their prefix (see the module docstring)."""
    rng = np.random.default_rng(seed)
    parents *= population
    ch, rows, chains = _Chains(), [], []
    system = [("sys", i) for i in range(_blocks(12_000))]
    sid = 0
    for p in range(parents):
        me, sid = sid, sid + 1
        ctx = system + [("own", me, i) for i in range(_blocks(6_000))]
        t = float(rng.uniform(0, 120))
        for k in range(turns):
            _request(rows, chains, ch, t, ctx, 300, me, _TOOL)
            t += len(ctx) * BLOCK_TOKENS / PREFILL_TPS + 6.0
            if k and rng.random() < 0.3:   # fork sub-agents from this prefix
                ends = []
                for _ in range(int(rng.integers(1, 5))):
                    sub, sid = sid, sid + 1
                    sctx = ctx + [("own", sub, i) for i in range(_blocks(3_000))]
                    st = t + float(rng.uniform(0, 2))
                    for _ in range(int(rng.integers(3, 11))):
                        st += _request(rows, chains, ch, st, sctx, 250, sub, _TOOL)
                        st += _lognormal(rng, 2.0, 30.0)
                        sctx = sctx + [("own", sub, len(sctx) + i) for i in range(_blocks(1_200))]
                    ends.append(st)
                t = max(ends) + 1.0
                ctx = ctx + [("own", me, len(ctx) + i) for i in range(_blocks(2_000))]
            else:
                t += _lognormal(rng, 3.0, 60.0)
            ctx = ctx + [("own", me, len(ctx) + i) for i in range(_blocks(1_500))]
    return build(f"forks(seed {seed}, {parents} parents)", BLOCK_TOKENS, rows, chains)


def chat(seed: int = 0, sessions: int = 600, rate_per_s: float = 0.2,
         population: int = 1) -> Workload:
    """Human chat sessions, no agent loop (see the module docstring)."""
    rng = np.random.default_rng(seed)
    sessions, rate_per_s = sessions * population, rate_per_s * population
    ch, rows, chains = _Chains(), [], []
    system = [("sys", i) for i in range(_blocks(1_024))]
    start = np.cumsum(rng.exponential(1.0 / rate_per_s, sessions))
    for s in range(sessions):
        ctx = system + [("own", s, i) for i in range(_blocks(int(rng.integers(200, 3_000))))]
        t = float(start[s])
        n = int(rng.geometric(0.25))
        for k in range(n):
            out = int(rng.integers(150, 700))
            t += _request(rows, chains, ch, t, ctx, out, s, _USER if k < n - 1 else 0)
            t += _lognormal(rng, 45.0, 900.0)
            add = _blocks(out + int(rng.integers(50, 800)))
            ctx = ctx + [("own", s, len(ctx) + i) for i in range(add)]
    return build(f"chat(seed {seed}, {sessions} sessions)", BLOCK_TOKENS, rows, chains)


def rag(seed: int = 0, sessions: int = 1500, documents: int = 60, agents: int = 4,
        duration_s: float = 3600.0, population: int = 1) -> Workload:
    """Short sessions over shared documents, beside a few long agents (module docstring);
    a larger `population` shares the same documents."""
    rng = np.random.default_rng(seed)
    sessions, agents = sessions * population, agents * population
    ch, rows, chains = _Chains(), [], []
    system = [("sys", i) for i in range(_blocks(1_024))]
    doc_blocks = rng.integers(_blocks(8_000), _blocks(32_000), documents)
    pop = 1.0 / np.arange(1, documents + 1) ** 1.1
    pop /= pop.sum()
    for s in range(sessions):
        t = float(rng.uniform(0, duration_s))
        picks = rng.choice(documents, size=int(rng.integers(1, 4)), replace=False, p=pop)
        ctx = system + [("doc", int(d), i) for d in picks for i in range(int(doc_blocks[d]))]
        n = int(rng.integers(1, 3))
        for k in range(n):
            ctx = ctx + [("own", s, len(ctx) + i) for i in range(_blocks(400))]
            t += _request(rows, chains, ch, t, ctx, 200, s, _USER if k < n - 1 else 0)
            t += _lognormal(rng, 20.0, 300.0)
    for a in range(agents):
        me = sessions + a
        ctx = [("agent-sys", i) for i in range(_blocks(16_000))] \
            + [("own", me, i) for i in range(_blocks(4_000))]
        t = float(rng.uniform(0, 60))
        while t < duration_s and len(ctx) * BLOCK_TOKENS < 120_000:
            t += _request(rows, chains, ch, t, ctx, 400, me, _TOOL)
            t += _lognormal(rng, 4.0, 90.0)
            ctx = ctx + [("own", me, len(ctx) + i) for i in range(_blocks(1_800))]
    return build(f"rag(seed {seed}, {sessions} sessions, {documents} documents, "
                 f"{agents} agents)", BLOCK_TOKENS, rows, chains)


def retime(work: Workload, factor: float) -> Workload:
    """The same requests with arrival times multiplied by `factor` (in place; returned)."""
    if factor != 1.0:
        work.arrival_s = work.arrival_s * factor
        work.name = f"{work.name}, time x{factor:g}"
    return work


GENERATORS = {"forks": forks, "chat": chat, "rag": rag}
