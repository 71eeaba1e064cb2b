"""What a replay measured, from its per-request records (`tools.replay.live`, `tools.replay.sim`).

Definitions (the same in both engine modes):
- token hit rate: tokens served from a cache (`cached`: vLLM's local prefix hit plus what
  a connector loaded, not what kvtier promised and the engine then recomputed, which vLLM
  itself counts as cached) over input tokens; per tier: `local` (vLLM's own prefix cache, i.e.
  `cached` minus what kvtier loaded) and each kvtier tier by name;
- TTFT: from when the request was sent (queueing included) to its first token; end-to-end:
  to its last token;
- throughput: input plus output tokens of every request over the makespan (first request
  sent to last response ended);
- bytes moved: read from each tier (`tokens loaded x bytes per token`), written to the first
  tier (chunks saved x chunk bytes); what the tiers hold at the end is added by the caller;
- KV ratio: at each request's start, the contexts (latest prompt) of the sessions live on
  its instance (served there before and not yet done) over the instance's KV cache, averaged
  over requests: how far the working set exceeds what vLLM's own cache can hold;
- recomputed: tokens a lookup promised from kvtier that the engine then computed (a load
  that failed or passed its deadline), over input tokens (vLLM engines; 0 in the sim);
- declined: tokens a lookup found in a tier and left to the engine because loading them
  would have taken longer than computing them, over input tokens (vLLM engines).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def pct(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(records: list[dict], tier_names: list[str], bytes_per_token: int,
              chunk_tokens: int, kv_tokens: int) -> dict:
    """Overall and per-turn numbers of one configuration."""
    overall = _block(records, tier_names, bytes_per_token, chunk_tokens)
    t0 = min(r["sent"] for r in records)
    t1 = max(r["end"] for r in records)
    tokens = sum(r["input_tokens"] + r["output_tokens"] for r in records)
    overall.update(makespan_s=t1 - t0, throughput_tps=tokens / max(t1 - t0, 1e-9),
                   kv_ratio=kv_ratio(records, kv_tokens))
    by_turn: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_turn[r["turn"]].append(r)
    per_turn = [{"turn": t + 1, **_block(rs, tier_names, bytes_per_token, chunk_tokens)}
                for t, rs in sorted(by_turn.items())]
    return {"overall": overall, "per_turn": per_turn}


def _block(records: list[dict], tier_names: list[str], bpt: int, chunk: int) -> dict:
    inp = sum(r["input_tokens"] for r in records)
    cached = sum(r["cached"] for r in records)
    tier_tok = {name: sum(r["tiers"].get(name, 0) for r in records) for name in tier_names}
    local = cached - sum(tier_tok.values())
    ttft = [r["ttft"] for r in records]
    e2e = [r["e2e"] for r in records]
    loads = [r["load_s"] for r in records if r.get("load_s")]
    return {
        "requests": len(records), "input_tokens": inp,
        "output_tokens": sum(r["output_tokens"] for r in records),
        "hit_rate": 100.0 * cached / max(inp, 1),
        "hit_by_tier": {"local": 100.0 * local / max(inp, 1),
                        **{n: 100.0 * v / max(inp, 1) for n, v in tier_tok.items()}},
        # promised by a lookup, then recomputed (a load that failed or passed its deadline)
        "recomputed_pct": 100.0 * sum(r.get("recomputed", 0) for r in records) / max(inp, 1),
        # found in a tier and recomputed because loading would have taken longer
        "declined_pct": 100.0 * sum(r.get("declined", 0) for r in records) / max(inp, 1),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "bytes_read": {n: v * bpt for n, v in tier_tok.items()},
        "bytes_saved": sum(r["saved_chunks"] for r in records) * chunk * bpt,
        "store_load_p50_s": pct(loads, 50),
    }


def kv_ratio(records: list[dict], kv_tokens: int) -> float:
    """Mean, over requests, of the live sessions' contexts on its instance / KV cache."""
    last_end: dict[int, float] = {}
    for r in records:
        last_end[r["session"]] = max(last_end.get(r["session"], 0.0), r["end"])
    touched: dict[int, set] = defaultdict(set)
    latest: dict[int, int] = {}
    samples = []
    for r in sorted(records, key=lambda r: r["start"]):
        s, k = r["session"], r["instance"]
        latest[s] = r["input_tokens"]
        touched[k].add(s)
        live = [x for x in touched[k] if last_end[x] >= r["start"]]
        samples.append(sum(latest[x] for x in live) / max(kv_tokens, 1))
    return float(np.mean(samples)) if samples else 0.0


def ratios(summary: dict, base: str, label: str) -> dict:
    """How `label` compares with `base` (TTFT P50 lower by, throughput higher by)."""
    a, b = summary[label]["overall"], summary[base]["overall"]
    return {"ttft_p50_lower_x": b["ttft_p50_s"] / max(a["ttft_p50_s"], 1e-9),
            "throughput_higher_x": a["throughput_tps"] / max(b["throughput_tps"], 1e-9),
            "e2e_p50_lower_x": b["e2e_p50_s"] / max(a["e2e_p50_s"], 1e-9)}
