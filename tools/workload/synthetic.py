"""The synthetic agentic workload of DESIGN.md, deterministic for a given seed.

Every session shares a `system_tokens` system prompt, sends `first_input_tokens` of its own,
then each turn appends the previous `output_tokens` and `turn_input_tokens` new ones, for
`turns` turns. A session's context only grows, so the block at a position is the same at
every turn: blocks wholly inside the system prompt are shared by all sessions, the others
belong to one session. Inter-turn gaps are log-normal with median `gap_median_s` and P99
`gap_p99_s` (i.i.d.: nothing about one gap predicts the next), counted from the end of the
previous turn's prefill at `prefill_tokens_per_s` for its whole input (the replay's
default rate), so a turn never arrives before its predecessor could have saved its blocks.
`sessions` sessions run in `live` slots: a slot starts its next session when the previous one
has ended, so about `live` are in progress at once, with staggered starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtier.tools.workload.traces import TraceError, Workload, build

_Z99 = 2.3263478740408408  # the standard normal's 0.99 quantile


@dataclass(frozen=True)
class SyntheticSpec:
    sessions: int = 64
    live: int = 64
    turns: int = 30
    system_tokens: int = 20_000
    first_input_tokens: int = 10_000
    turn_input_tokens: int = 2_048
    output_tokens: int = 900
    gap_median_s: float = 5.2
    gap_p99_s: float = 81.4
    prefill_tokens_per_s: float = 20_000.0
    start_spread_s: float = 60.0   # each slot's first session starts uniformly in [0, this)
    block_tokens: int = 256
    seed: int = 0

    def check(self) -> None:
        ints = ("sessions", "live", "turns", "block_tokens")
        if any(getattr(self, f) < 1 for f in ints) or self.system_tokens < 0 \
                or self.first_input_tokens < 1 or self.turn_input_tokens < 0 \
                or self.output_tokens < 0:
            raise TraceError(f"synthetic: sessions, live, turns, block_tokens must be >= 1 and "
                             f"token counts >= 0, got {self}")
        if not 0 < self.gap_median_s < self.gap_p99_s:
            raise TraceError("synthetic: need 0 < gap_median_s < gap_p99_s")

    def gap_lognormal(self) -> tuple[float, float]:
        """(mu, sigma) of the log-normal gap with this median and P99."""
        return (math.log(self.gap_median_s),
                math.log(self.gap_p99_s / self.gap_median_s) / _Z99)


def synthetic(spec: SyntheticSpec = SyntheticSpec()) -> Workload:
    """Generate the workload (see the module docstring)."""
    spec.check()
    rng = np.random.default_rng(spec.seed)
    mu, sigma = spec.gap_lognormal()
    shared_blocks = spec.system_tokens // spec.block_tokens
    step = spec.turn_input_tokens + spec.output_tokens
    inputs = spec.system_tokens + spec.first_input_tokens + step * np.arange(spec.turns)
    n_blocks = inputs // spec.block_tokens
    slots = rng.uniform(0.0, spec.start_spread_s, spec.live)
    rows, chains = [], []
    for s in range(spec.sessions):
        gaps = rng.lognormal(mu, sigma, spec.turns - 1) \
            + inputs[:-1] / spec.prefill_tokens_per_s
        slot = int(np.argmin(slots))
        times = slots[slot] + np.concatenate([[0.0], np.cumsum(gaps)])
        slots[slot] = times[-1] + float(rng.lognormal(mu, sigma))
        # ids: shared positions are their own id; a session's own positions are offset
        own = (s + 1) << 32
        full = np.arange(n_blocks[-1], dtype=np.int64)
        ids = np.where(full < shared_blocks, full, full + own)
        for k in range(spec.turns):
            rows.append((times[k], inputs[k], spec.output_tokens, s, 0,
                         inputs[k] / spec.prefill_tokens_per_s))
            chains.append(ids[:n_blocks[k]])
    return build(f"synthetic({spec.sessions} sessions, {spec.live} live)", spec.block_tokens,
                 rows, chains)
