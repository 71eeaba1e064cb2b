"""The main job's targets, evaluated on an engine replay's report (`tools.replay.experiment`).

Each check compares configurations of the same run, never against fixed timings:
- main: kvtier (its largest DRAM pool) against `local` (vLLM's prefix cache only): token
  hit rate >= 95%, TTFT P50 >= 5x lower, throughput >= 2x higher. Their notes say what
  bounds them in this run: the hit rate an infinite cache would get (`Plan.reuse_bound`),
  and how long the prompts are (a hit saves at most the prefill it replaces);
- small pool: kvtier with the DRAM pool cut to a smaller fraction is within 2 points of the
  largest pool's hit rate; the DRAM-only pool of the same size is reported beside it;
- peers: kvtier against each peer (`mooncake-store`, `lmcache`) with a pool of the same
  size: hit rate at least the peer's, and with a pool smaller than the working set at least
  30 points above a peer that has only DRAM (its note says when an infinite cache leaves
  less room than that), TTFT P50 and P99 at most the peer's, throughput at least the
  peer's;
- scaling (an instance sweep): kvtier's hit rate stays within 2 points across instance
  counts, and throughput within 20% of linear (throughput(n) / (throughput(n0) * n / n0)).
A check whose configurations did not run is left out.
"""

from __future__ import annotations

from kvtier.tools.replay.cluster import PEERS

# Points of hit rate kvtier keeps above a DRAM-only peer when the pool is smaller than the
# working set (what its nvme and shared tiers are for).
SMALL_POOL_LEAD = 30.0
DRAM_ONLY_PEERS = ("mooncake-store", "lmcache")


def evaluate(report: dict) -> list[dict]:
    out: list[dict] = []
    for run in report["runs"]:
        out += _main(run) + _small_pool(run) + _peers(run)
    if len(report["runs"]) > 1:
        out += _scaling(report["runs"])
    return out


def _kvtier_labels(run: dict) -> list[tuple[float, str]]:
    return sorted(((c["dram_frac"], label) for label, c in run["configs"].items()
                   if c["kind"] == "kvtier"), reverse=True)


def _check(what: str, value: float, ok: bool, target: str, n: int, note: str = "") -> dict:
    return {"instances": n, "what": what, "value": round(value, 2), "target": target,
            "ok": bool(ok), "note": note}


def _main(run: dict) -> list[dict]:
    cfgs, n = run["configs"], run["instances"]
    kv = _kvtier_labels(run)
    if not kv:
        return []
    best = cfgs[kv[0][1]]["overall"]
    bound = run.get("reuse_bound_pct")
    note = "" if bound is None else \
        f"an infinite cache would hit {bound:.1f}% of this run (the rest is seen first here)"
    out = [_check("kvtier token hit rate %", best["hit_rate"], best["hit_rate"] >= 95.0,
                  ">= 95", n, note)]
    if "local" in cfgs:
        base = cfgs["local"]["overall"]
        tokens = run.get("input_tokens", 0) / max(run.get("requests", 1), 1)
        note = f"local (vLLM's own prefix cache only) hit {base['hit_rate']:.1f}%; prompts " \
               f"average {tokens:,.0f} tokens here: the cheaper a prefill, the less a hit saves"
        ttft = base["ttft_p50_s"] / max(best["ttft_p50_s"], 1e-9)
        thr = best["throughput_tps"] / max(base["throughput_tps"], 1e-9)
        out += [_check("TTFT P50 lower than baseline, x", ttft, ttft >= 5.0, ">= 5", n, note),
                _check("throughput higher than baseline, x", thr, thr >= 2.0, ">= 2", n,
                       note)]
    return out


def _small_pool(run: dict) -> list[dict]:
    cfgs, n = run["configs"], run["instances"]
    kv = _kvtier_labels(run)
    out = []
    if len(kv) < 2:
        return out
    top_frac, top = kv[0]
    top_hit = cfgs[top]["overall"]["hit_rate"]
    for frac, label in kv[1:]:
        hit = cfgs[label]["overall"]["hit_rate"]
        dram_only = next((c["overall"]["hit_rate"] for c in cfgs.values()
                          if c["kind"] == "dram-only" and c["dram_frac"] == frac), None)
        note = (f"unconstrained ({100 * top_frac:g}%) {top_hit:.1f}%"
                + ("" if dram_only is None else
                   f"; DRAM-only pool of {100 * frac:g}%: {dram_only:.1f}%"))
        out.append(_check(f"kvtier hit rate % with DRAM at {100 * frac:g}% of the working set",
                          hit, hit >= top_hit - 2.0, f">= {top_hit - 2.0:.1f}", n, note))
    return out


def _peers(run: dict) -> list[dict]:
    cfgs, n = run["configs"], run["instances"]
    kv = {frac: label for frac, label in _kvtier_labels(run)}
    out = []
    for label, c in cfgs.items():
        mine = kv.get(c["dram_frac"])
        if c["kind"] not in PEERS or mine is None:
            continue
        theirs, ours = c["overall"], cfgs[mine]["overall"]
        # a pool that cannot hold the working set is where tiers below DRAM pay: against a
        # peer with DRAM only, kvtier must keep hits the peer's pool drops
        lead = SMALL_POOL_LEAD if c["dram_frac"] < 1 and c["kind"] in DRAM_ONLY_PEERS else 0.0
        need, bound = theirs["hit_rate"] + lead, run.get("reuse_bound_pct")
        out.append(_check(f"{mine} hit rate % against {label}", ours["hit_rate"],
                          ours["hit_rate"] >= need, f">= {need:.1f}", n,
                          f"above an infinite cache's {bound:.1f}%"
                          if lead and bound is not None and need > bound else ""))
        for q in ("p50", "p99"):
            ratio = ours[f"ttft_{q}_s"] / max(theirs[f"ttft_{q}_s"], 1e-9)
            out.append(_check(f"{mine} TTFT {q.upper()} / {label}'s", ratio, ratio <= 1.0,
                              "<= 1", n, f"{label}: {theirs[f'ttft_{q}_s'] * 1e3:,.0f} ms"))
        ratio = ours["throughput_tps"] / max(theirs["throughput_tps"], 1e-9)
        out.append(_check(f"{mine} throughput / {label}'s", ratio, ratio >= 1.0, ">= 1", n,
                          f"{label}: {theirs['throughput_tps']:,.0f} tok/s"))
    return out


def _scaling(runs: list[dict]) -> list[dict]:
    pts = []
    for run in runs:
        kv = _kvtier_labels(run)
        if kv:
            o = run["configs"][kv[0][1]]["overall"]
            pts.append((run["instances"], o["hit_rate"], o["throughput_tps"]))
    if len(pts) < 2:
        return []
    n0, _, thr0 = pts[0]
    hits = [h for _, h, _ in pts]
    spread = max(hits) - min(hits)
    out = [_check("kvtier hit rate spread across instance counts, points", spread,
                  spread <= 2.0, "<= 2", pts[-1][0],
                  ", ".join(f"{n}: {h:.1f}%" for n, h, _ in pts))]
    for n, _, thr in pts[1:]:
        eff = thr / (thr0 * n / n0)
        out.append(_check(f"throughput at {n} instances / linear from {n0}", eff,
                          eff >= 0.8, ">= 0.8", n))
    return out
