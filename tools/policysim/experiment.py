"""The experiment behind `kvtier replay --simulate`: every policy at every capacity, in one run.

For each workload (the synthetic agentic workload, the WEKA Claude Code sessions, the
Mooncake conversation trace): compile it once (`tools.policysim.segments`), replay it through each
policy at each capacity (fractions of its unique footprint) plus `belady` and an infinite
cache, in parallel processes (fork: the compiled workload is shared, not copied), and the
tiered variant (dram + nvme + sharedfs) for `lru` and `agentic`. Returns plain data (the
`--json` output) with the issue's targets evaluated:
(a) on synthetic and weka, wherever belady leads the best classic policy by `gap_min`
    points or more, agentic closes at least half of that gap;
(b) everywhere, agentic is at most `slack` points below the best classic policy;
(c) tiered: the hit rate is within 1 point of the infinite cache.
With `online_bound`, the synthetic rows also get an upper bound on the hit rate any online
policy can reach (`tools.policysim.online_bound`): what (a) can ask of a policy that does not
see the future. With `gap_oracle`, the synthetic and weka rows also get agentic told each turn's
true next gap with each given error (`tools.policysim.oracle`): what better gap predictions buy.
With `gap_info`, each workload with sessions also gets how much of its gaps' spread what a
server knows at a turn's end explains (`tools.policysim.gap_info`), in the oracle's units.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from kvtier.store.base.config import kvtier_home
from kvtier.tools.jsonout import plain
from kvtier.tools.policysim.gap_info import gap_info
from kvtier.tools.policysim.online_bound import online_bound
from kvtier.tools.policysim.oracle import GapOracleReplay
from kvtier.tools.policysim.replay import Replay, SimParams, total_input_tokens
from kvtier.tools.policysim.segments import Compiled, compile_workload
from kvtier.tools.policysim.tiered import TieredReplay
from kvtier.tools.workload.generators import GENERATORS, retime
from kvtier.tools.workload.synthetic import SyntheticSpec, synthetic
from kvtier.tools.workload.traces import (TRACE_FILES, Workload, load_mooncake, load_weka,
                                          restrict_gap_classes)

CLASSIC = ("lru", "s3fifo", "arc")
SELECTED = "agentic+select"
BOUND = "online_bound"  # a job computing the online bound, not a policy
ORACLE = "told ±"  # + the error's sigma: agentic told the true gaps (`sim_oracle`)
GAP_TARGETS = ("synthetic", "weka")  # where target (a) applies


@dataclass
class RunSpec:
    workloads: tuple[str, ...] = ("synthetic", "weka", "conversation")
    policies: tuple[str, ...] = ("lru", "s3fifo", "arc", "agentic")
    capacities: tuple[float, ...] = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
    tiered: tuple[float, float, float] | None = (0.005, 0.05, 1.0)
    traces: Path = Path("../shared/traces")
    synthetic: SyntheticSpec = field(default_factory=SyntheticSpec)
    weka_live: int = 32
    weka_chunk_tokens: int = 256
    seed: int = 0
    sim: SimParams = field(default_factory=SimParams)
    jobs: int = 2
    cache: bool = True
    gap_min: float = 5.0
    slack: float = 0.5
    online_bound: bool = False   # synthetic only: its gap distribution is known
    gap_oracle: tuple[float, ...] = ()   # agentic told the true gaps with these errors
    gap_classes: str = "trace"   # what the replay tells of each wait (`traces.GAP_CLASS_MODES`)
    gap_info: bool = False       # how much of the gaps' spread a server's features explain
    time_scale: float = 1.0      # arrival times multiplied by this (0.1: 10x compressed)
    population: int = 1          # generated workloads: this many times the sessions


def load(name: str, spec: RunSpec) -> Compiled:
    """Load and compile a workload, through an on-disk cache keyed by its inputs (the
    generated ones are made again: it is quicker)."""
    if name == "synthetic":
        return compile_workload(retime(synthetic(spec.synthetic), spec.time_scale), 16)
    if name in GENERATORS:
        return compile_workload(retime(GENERATORS[name](spec.seed, population=spec.population),
                                        spec.time_scale), 16)
    path = spec.traces / TRACE_FILES[name]
    key = _cache_key(name, path, spec)
    cached = kvtier_home() / "replay-cache" / f"{name}-{key}.npz"
    if spec.cache and cached.exists():
        return _read_cache(cached)
    if name == "weka":
        work, seg = load_weka(path, spec.weka_chunk_tokens, spec.weka_live, spec.seed), 64
    else:
        work, seg = load_mooncake(path), 8
    c = compile_workload(retime(work, spec.time_scale), seg)
    if spec.cache:
        cached.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        _write_cache(tmp, c)
        os.replace(tmp, cached)
    return c


def _write_cache(path: Path, c: Compiled) -> None:
    """Arrays and a JSON header in an .npz: a cache file is data, never code (no pickle)."""
    w = c.work
    arrays = {f"work.{f.name}": getattr(w, f.name) for f in fields(w)
              if isinstance(getattr(w, f.name), np.ndarray)}
    arrays.update({f.name: getattr(c, f.name) for f in fields(c) if f.name != "work"})
    meta = json.dumps({"name": w.name, "block_tokens": w.block_tokens,
                       "gap_names": list(w.gap_names)}).encode()
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(meta, dtype=np.uint8), **arrays)


def _read_cache(path: Path) -> Compiled:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]))
        work = Workload(meta["name"], meta["block_tokens"], gap_names=tuple(meta["gap_names"]),
                        **{k[5:]: z[k] for k in z.files if k.startswith("work.")})
        return Compiled(work, **{k: z[k] for k in z.files
                                 if k != "meta" and not k.startswith("work.")})


def _cache_key(name: str, path: Path, spec: RunSpec) -> str:
    files = sorted(path.glob("trace_*.json*")) if path.is_dir() else [path]
    h = hashlib.sha256(repr((name, spec.weka_live, spec.weka_chunk_tokens, spec.seed, 3,
                                  spec.time_scale)).encode())
    for f in files:
        st = f.stat() if f.exists() else None
        h.update(f"{f.name}:{st and st.st_size}:{st and st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


_WORK: dict[str, Compiled] = {}  # filled before the pool forks
_SYNTHETIC: list[SyntheticSpec] = []  # the synthetic workload's spec, for the online bound


def _job(args) -> tuple:
    name, policy, frac, tiered, params = args
    c = _WORK[name]
    t0 = time.perf_counter()
    total = total_input_tokens(c)
    fp = c.footprint_blocks * c.work.block_tokens * params.bytes_per_token
    if policy == BOUND:
        fp_tokens = c.footprint_blocks * c.work.block_tokens
        rate = online_bound(c.work, _SYNTHETIC[0], [frac * fp_tokens],
                            params.prefill_tokens_per_s)[0]
        return name, policy, frac, 100.0 * rate, time.perf_counter() - t0, {}
    if policy.startswith(ORACLE):
        rp = GapOracleReplay(c, "agentic", frac * fp, params, float(policy[len(ORACLE):]))
        return name, policy, frac, 100.0 * rp.run() / total, time.perf_counter() - t0, {}
    if tiered:
        rp = TieredReplay(c, policy, tuple(f * fp for f in tiered), params)
        hits = rp.run()
        extra = {"dram_share": 100.0 * rp.dram_hit_tokens / max(hits, 1)}
    else:
        cpu = time.process_time()
        rp = Replay(c, policy, frac * fp if frac is not None else float("inf"), params)
        hits = rp.run()
        extra = {"cpu_s": time.process_time() - cpu}
    return name, policy, frac, 100.0 * hits / total, time.perf_counter() - t0, extra


def run(spec: RunSpec, progress=None) -> dict:
    """Run the whole experiment; `progress(done, total)` is called as jobs finish."""
    t0 = time.time()
    for name in spec.workloads:
        _WORK[name] = load(name, spec)
        restrict_gap_classes(_WORK[name].work, spec.gap_classes)
    _SYNTHETIC[:] = [spec.synthetic]
    jobs = []
    for name in spec.workloads:
        jobs.append((name, "lru", None, None, spec.sim))  # the infinite cache
        for frac in spec.capacities:
            for pol in (*spec.policies, "belady"):
                jobs.append((name, pol, frac, None, spec.sim))
            if spec.online_bound and name == "synthetic":
                jobs.append((name, BOUND, frac, None, spec.sim))
            if name in GAP_TARGETS:
                jobs += [(name, f"{ORACLE}{s:g}", frac, None, spec.sim) for s in spec.gap_oracle]
        if spec.tiered:
            jobs += [(name, pol, None, spec.tiered, spec.sim) for pol in ("lru", "agentic")]
    jobs.sort(key=lambda j: (j[0] != "weka", j[3] is None))  # long ones first
    results = []
    with ProcessPoolExecutor(max(1, spec.jobs), mp_context=mp.get_context("fork")) as ex:
        for i, res in enumerate(ex.map(_job, jobs)):
            results.append((jobs[i], res))
            if progress:
                progress(i + 1, len(jobs))
    return _report(spec, results, time.time() - t0)


def _report(spec: RunSpec, results, wall_s: float) -> dict:
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "wall_s": round(wall_s, 1),
           "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
           "spec": plain(asdict(spec)), "workloads": {}}
    for name in spec.workloads:
        c = _WORK[name]
        w = out["workloads"][name] = {
            "name": c.work.name, "requests": len(c.work),
            "footprint_tokens": c.footprint_blocks * c.work.block_tokens,
            "block_tokens": c.work.block_tokens, "rows": [], "tiered": {},
            "cpu_s": {}}
        if spec.gap_info:
            w["gap_info"] = gap_info(c.work, spec.seed)
        rows: dict = {}
        for (wl, pol, frac, tiered, _), (_, _, _, rate, secs, extra) in results:
            if wl != name:
                continue
            if tiered:
                w["tiered"][pol] = {"hit": rate, "seconds": secs, **extra}
            elif frac is None:
                w["infinite"] = rate
            else:
                rows.setdefault(frac, {"capacity": frac})[pol] = rate
                w["cpu_s"][pol] = w["cpu_s"].get(pol, 0.0) + extra.get("cpu_s", secs)
        for frac in spec.capacities:
            w["rows"].append(_targets(rows[frac], spec, name))
        for t in w["tiered"].values():
            t["within_1pt"] = t["hit"] >= w["infinite"] - 1.0
    return out


def _targets(row: dict, spec: RunSpec, name: str) -> dict:
    classic = [p for p in CLASSIC if p in row]
    if not classic or "agentic" not in row:
        return row
    best = max(row[p] for p in classic)
    gap = row["belady"] - best
    row["best_classic"], row["gap"] = best, gap
    row["closed"] = (row["agentic"] - best) / gap if gap > 0 else None
    row["target_a"] = (None if name not in GAP_TARGETS or gap < spec.gap_min
                       else row["agentic"] - best >= gap / 2)
    row["target_b"] = row["agentic"] >= best - spec.slack
    if SELECTED in row:  # (b'): with selection, also never far below agentic alone
        row["target_b_select"] = row[SELECTED] >= max(best, row["agentic"]) - spec.slack \
            or row[SELECTED] >= best - spec.slack and row["agentic"] < best
    return row

