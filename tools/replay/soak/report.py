"""The report of `kvtier replay --soak` (plain data, the `--json` output) and its verdict.

`report(soak, reps, end, checks, bound_s)` gathers, from the soak's state
(`tools.replay.soak.run.Soak`): the faults injected and skipped per kind and their log; the
requests completed, failed and retried and how instances died; wrong blocks served; corrupt
blocks detected (the tiers' `corrupt` counters of every process of every node, the read-back
at the end included) and what the read-back found, per tier; the mover's failed copies (a
full disk, the pool gone), puts that found a tier full and tier errors it absorbed; per
interval of `fault_every_s` (the fault named is the one injected at its start) the requests
and the hit rates, so recovery after each fault shows; the master's recovery times;
`inspect check` per node, problems by kind. `ok` is the verdict, `why_not` says what failed
it.
"""

from __future__ import annotations

import statistics
from collections import Counter

# the mover's counters worth showing: moves a full disk refused, and tier errors it absorbed
MOVER_SHOWN = ("full_", "errors", "copy_errors")


def report(soak, reps: int, end: dict, checks: dict, bound_s: float) -> dict:
    inj = soak.injector
    ivs = intervals(soak)
    totals = Counter()
    for iv in soak.intervals.values():
        totals.update(iv)
    wrong = totals["wrong"] + sum(c.get("wrong", 0) for c in end["scrub"].values())
    corrupt, mover = Counter(), Counter()
    for tiers in end["counters"].values():
        for tier, c in tiers.items():
            if tier == "mover":
                mover.update({k: v for k, v in c.items() if k.startswith(MOVER_SHOWN)})
            else:
                corrupt[tier] += c.get("corrupt", 0)
    out = {
        "repetitions": reps,
        "faults": inj.counts, "fault_log": inj.log,
        "requests": {"completed": totals["completed"], "looked_up": totals["requests"],
                     "failed": totals["failed"], "retried": totals["retried"]},
        "instance_deaths": dict(soak.kills),
        "wrong_blocks": wrong,
        "corrupted": {"shared": len(inj.corrupted["shared"]),
                      "nvme": sum(len(v) for k, v in inj.corrupted.items() if k != "shared")},
        "corrupt_detected": dict(corrupt),
        "read_back": end["scrub"],
        "mover": dict(mover),
        "hit_pct": _pct(totals["hit"], totals["blocks"]),
        "intervals": ivs,
        "master": master_recovery(inj, bound_s),
        "by_fault": by_fault(ivs, inj),
        "check": check_summary(checks),
        "failures": soak.failures[:50],
    }
    out["why_not"] = verdict(out, bound_s)
    out["ok"] = not out["why_not"]
    return out


def intervals(soak) -> list[dict]:
    faults = {e["interval"]: e["kind"] + (" (skipped)" if e["skipped"] else "")
              for e in soak.injector.log}
    every = soak.spec.fault_every_s
    out = []
    for k in range(max(soak.intervals, default=-1) + 1):
        iv = soak.intervals.get(k, Counter())
        out.append({
            "interval": k, "from_s": round(k * every, 1), "fault": faults.get(k),
            "requests": iv["requests"], "completed": iv["completed"],
            "hit_pct": _pct(iv["hit"], iv["blocks"]),
            "kvtier_hit_pct": _pct(iv["hit"] - iv["local"], iv["blocks"] - iv["local"]),
            "blocks_from": {t: iv["from_" + t] for t in ("dram", "nvme", "shared")},
            "failed": iv["failed"], "retried": iv["retried"], "wrong": iv["wrong"]})
    return out


def by_fault(ivs: list[dict], inj) -> dict:
    """Per fault kind: how often, the failed requests and wrong blocks of the intervals it
    began, and the seconds from its end to the next pool hit (`recovery_s`)."""
    out: dict = {}
    for kind, c in inj.counts.items():
        mine = [iv for iv in ivs if iv["fault"] == kind]
        master = kind == "master-restart"
        rec = inj.recovery_s if master else inj.recovery_by_fault.get(kind, [])
        out[kind] = {**c, "failed": sum(iv["failed"] for iv in mine),
                     "wrong": sum(iv["wrong"] for iv in mine), "recovery_s": rec,
                     "recovery_max_s": max(rec) if rec else None,
                     "recovery_median_s": round(statistics.median(rec), 2) if rec else None,
                     "unrecovered_s": inj.unrecovered_s if master else
                     inj.unrecovered_by_fault.get(kind, [])}
    if "leader-kill" in out:  # how much of each recovery was the election
        out["leader-kill"]["elected_s"] = list(inj.elected_s)
    return out


def master_recovery(inj, bound_s: float) -> dict:
    rec = inj.recovery_s
    return {"restarts": inj.counts.get("master-restart", {}).get("injected", 0),
            "down_s": round(inj.down_s, 2), "recovery_s": rec,
            "max_s": max(rec) if rec else None,
            "median_s": round(statistics.median(rec), 2) if rec else None,
            "unrecovered_s": inj.unrecovered_s, "bound_s": bound_s}


def check_summary(checks: dict) -> dict:
    """Problems by kind over every node (a shared-dir problem every node reports is one)."""
    seen, kinds = set(), Counter()
    for rep in checks.values():
        for p in rep.problems:
            ident = (p.kind, p.tier, p.key, p.path)
            if ident not in seen:
                seen.add(ident)
                kinds[p.kind] += 1
    return {"clean": all(r.clean for r in checks.values()), "problems_by_kind": dict(kinds),
            "nodes": {node: r.to_dict() for node, r in checks.items()}}


def verdict(r: dict, bound_s: float) -> list[str]:
    why = []
    if r["wrong_blocks"]:
        why.append(f"{r['wrong_blocks']} wrong blocks served")
    if r["requests"]["failed"]:
        why.append(f"{r['requests']['failed']} failed requests")
    if not r["requests"]["completed"]:
        why.append("no request completed")
    if not r["check"]["clean"]:
        why.append(f"check not clean: {r['check']['problems_by_kind'] or 'unchecked tiers'}")
    m = r["master"]
    slow = [s for s in m["recovery_s"] + m["unrecovered_s"] if s > bound_s]
    if slow:
        why.append(f"the pool served no hit within {bound_s:.0f} s of a master restart "
                   f"({len(slow)} times)")
    for kind, f in r.get("by_fault", {}).items():
        if kind == "master-restart":
            continue  # above
        late = [x for x in f["recovery_s"] + f["unrecovered_s"] if x > bound_s]
        if late:
            why.append(f"the pool served no hit within {bound_s:.0f} s of a {kind} "
                       f"({len(late)} times)")
    return why


def _pct(a: int, b: int) -> float | None:
    return round(100 * a / b, 1) if b > 0 else None
