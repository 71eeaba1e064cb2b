"""The experiment behind `kvtier replay --engine vllm|sim`: every configuration, one run.

For each instance count (one, or a sweep with sessions scaled alongside), the workload is
turned into a plan (`tools.replay.plan`), sized (the working set, the per-instance KV cache:
at most 1/`kv_ratio` of the contexts live on an instance, at least one longest request), and
replayed against each configuration (`tools.replay.cluster.configs`: kvtier at each DRAM
size, the DRAM-only pool at each size, local prefix caches only), each on a fresh cluster,
in turn, or (`side_by_side`, real engines) all at once so that the load of other jobs on a
shared machine hits each alike (`tools.replay.runners`). Returns plain data (the `--json`
output) with the issue's targets evaluated (`tools.replay.targets`).
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kvtier.store.base import block
from kvtier.tools.jsonout import plain
from kvtier.tools.replay.cluster import PEERS, POOLS, Config, ReplayError, Sizing, configs
from kvtier.tools.replay.metrics import summarize
from kvtier.tools.replay.plan import Plan, PlanSpec, make_plan
from kvtier.tools.replay.router import ROUTERS
from kvtier.tools.replay.runners import RunCtx, run_config, run_side_by_side
from kvtier.tools.replay.targets import evaluate
from kvtier.tools.vllm_engine import TINY_MODEL

ENGINES = ("vllm", "sim")
WORKLOADS = ("synthetic", "weka", "conversation")


@dataclass(frozen=True)
class EngineSpec:
    engine: str = "sim"
    workload: str = "synthetic"
    instances: tuple[int, ...] = (4,)
    router: str = "round-robin"
    sessions: int = 8               # with one instance count; else per instance
    live: int = 0                   # sessions in progress at once (0: all)
    turns: int = 30
    scale: float = 0.1              # real tokens per workload token
    speed: float = 1.0
    dram: tuple[float, ...] = (1.5,)  # DRAM pool sizes, fractions of the working set
    baselines: tuple[str, ...] = ("local", "dram-only")
    kv_ratio: float = 4.0
    kv_tokens: int = 0              # 0: sized from kv_ratio
    chunk_tokens: int = 32
    max_output: int = 32
    max_context: int = 16_384
    max_batch: int = 8
    side_by_side: bool = False      # vllm: run the configurations at the same time
    pool: str = "auto"              # vllm: auto | files | service | embedded (`VllmCluster`)
    multiproc: bool = False         # vllm: scheduler and worker in processes of their own
    dtype: str = "bfloat16"
    eviction: str = "lru"
    admission: str = "reuse"
    seed: int = 0
    traces: Path = Path("../shared/traces")
    out: Path = Path("replay-out")
    calibration: Path | None = None
    hosts: int = 1                  # instances spread round-robin over this many hosts
    shared_fs: str = "dir"          # with hosts: the sharedfs tier on one dir | on GlusterFS

    def check(self) -> None:
        if self.engine not in ENGINES:
            raise ReplayError(f"--engine: expected one of {', '.join(ENGINES)}, "
                              f"got {self.engine!r}")
        if self.workload not in WORKLOADS:
            raise ReplayError(f"--workload: expected one of {', '.join(WORKLOADS)}, got "
                              f"{self.workload!r} (engine replay takes one workload)")
        if self.router not in ROUTERS:
            raise ReplayError(f"--router: expected one of {', '.join(ROUTERS)}, "
                              f"got {self.router!r}")
        if self.chunk_tokens % 32:
            raise ReplayError("--chunk-tokens must be a multiple of 32 (the engines' block "
                              f"size), got {self.chunk_tokens}")
        from kvtier.store.base.policies import ADMISSION_KINDS, EVICTION_KINDS
        known = ("local", "dram-only", *PEERS)
        bad = [b for b in self.baselines if b not in known]
        if bad:
            raise ReplayError(f"--baselines: unknown {bad[0]!r}; known: {', '.join(known)}")
        peers = [b for b in self.baselines if b in PEERS]
        if peers and (self.engine != "vllm" or self.hosts > 1):
            raise ReplayError(f"--baselines {peers[0]}: a peer runs on real engines on one "
                              "host; use --engine vllm --hosts 1, or leave it out")
        if self.eviction not in EVICTION_KINDS or self.eviction == "belady":
            raise ReplayError(f"--eviction: expected an online policy, one of "
                              f"{', '.join(k for k in EVICTION_KINDS if k != 'belady')}")
        if self.admission not in ADMISSION_KINDS:
            raise ReplayError(f"--admission: expected one of {', '.join(ADMISSION_KINDS)}")
        if min(self.instances) < 1 or self.scale <= 0 or self.speed <= 0:
            raise ReplayError("--instances, --scale and --speed must be positive")
        if self.hosts < 1:
            raise ReplayError(f"--hosts must be at least 1, got {self.hosts}")
        if self.pool not in POOLS:
            raise ReplayError(f"--pool: expected one of {', '.join(POOLS)}, got {self.pool!r}")
        if self.shared_fs not in ("dir", "glusterfs"):
            raise ReplayError(f"--shared-fs: expected dir or glusterfs, got {self.shared_fs!r}")
        if self.shared_fs == "glusterfs":
            from kvtier.tools.hosts.glusterfs import unavailable as no_gluster
            why = "it needs --hosts 2 or more" if self.hosts < 2 else no_gluster(hosts=True)
            if why:
                raise ReplayError(f"--shared-fs glusterfs: {why}; or leave it out (one "
                                  "directory of this machine)")
        if self.hosts > 1:
            from kvtier.tools.hosts.netns import unavailable
            why = unavailable()
            if why:
                raise ReplayError(f"--hosts {self.hosts}: {why}; or run on one host "
                                  "(--hosts 1)")
            if self.engine == "vllm" and self.pool in ("service", "files"):
                what = "a pool service" if self.pool == "service" else "segment files"
                raise ReplayError(f"--hosts {self.hosts} with --pool {self.pool}: only the "
                                  f"engines of one host share {what}; use --pool embedded")
            if self.side_by_side:
                raise ReplayError("--hosts runs the configurations one after the other; "
                                  "drop --side-by-side")


def bytes_per_token(dtype: str) -> int:
    m = TINY_MODEL
    head = m["hidden_size"] // m["num_attention_heads"]
    elem = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    return m["num_hidden_layers"] * m["num_key_value_heads"] * 2 * head * elem


def build_plan(spec: EngineSpec, sessions: int) -> Plan:
    from kvtier.tools.workload.synthetic import SyntheticSpec, synthetic
    from kvtier.tools.workload.traces import TRACE_FILES, load_mooncake, load_weka
    pspec = PlanSpec(block_tokens=spec.chunk_tokens, max_context=spec.max_context,
                     max_output=spec.max_output, turns=spec.turns, seed=spec.seed)
    if spec.workload == "synthetic":
        s = spec.scale
        work = synthetic(SyntheticSpec(
            sessions=sessions, live=spec.live or sessions, turns=spec.turns,
            system_tokens=round(20_000 * s), first_input_tokens=round(10_000 * s),
            turn_input_tokens=round(2_048 * s), output_tokens=round(900 * s),
            prefill_tokens_per_s=20_000 * s, block_tokens=spec.chunk_tokens, seed=spec.seed))
        # generated at `s` of the full workload's token counts: that is the plan's scale
        return replace(make_plan(work, pspec, scale=1.0), scale=s)
    if spec.workload == "weka":
        trace_block = max(64, round(spec.chunk_tokens / spec.scale / 64) * 64)
        work = load_weka(spec.traces / TRACE_FILES["weka"], trace_block,
                         spec.live or min(sessions, 32), spec.seed, max_sessions=sessions)
        return make_plan(work, pspec)
    work = load_mooncake(spec.traces / TRACE_FILES["conversation"],
                         max_requests=sessions * spec.turns)
    return make_plan(work, replace(pspec, turns=None))


def kv_tokens_for(spec: EngineSpec, plan: Plan, n: int) -> tuple[int, int]:
    """(max_model_len, KV cache tokens per instance), both whole engine blocks."""
    bs = 32
    max_len = int((plan.input_tokens + plan.output_tokens).max()) + bs
    max_len = -(-max_len // bs) * bs
    if spec.kv_tokens:
        return max_len, max(max_len, -(-spec.kv_tokens // bs) * bs)
    first, last = {}, {}
    for s, t in zip(plan.session, plan.arrival_s):
        first.setdefault(int(s), t)
        last[int(s)] = t
    live = [sum(1 for s in first if first[s] <= t <= last[s]) for t in plan.arrival_s]
    share = n if spec.router == "session-sticky" else 1
    est = float(np.mean(live)) * float(plan.input_tokens.mean()) / share
    return max_len, max(max_len, -(-int(est / spec.kv_ratio) // bs) * bs)


def run_engine_replay(spec: EngineSpec, ui) -> dict:
    """Run every instance count and configuration; `ui` has `say(msg)` and `phase(desc,
    total) -> update(done)`."""
    spec.check()
    t0 = time.time()
    bpt = bytes_per_token(spec.dtype)
    payload = spec.chunk_tokens * bpt
    prepared = []
    for n in spec.instances:  # every size checked before anything runs
        sessions = spec.sessions * n if len(spec.instances) > 1 else spec.sessions
        plan = build_plan(spec, sessions)
        sizing = Sizing(payload, plan.unique_blocks * block.frame_size(payload, block.PAGE), n)
        cfgs = _runnable(configs(spec.dram, spec.baselines), ui)
        for cfg in cfgs:
            if cfg.pooled:
                sizing.segment_bytes(cfg.dram_frac)  # raises ReplayError when too small
        prepared.append((n, plan, sizing, cfgs))
    runs = []
    for n, plan, sizing, cfgs in prepared:
        max_len, kv_tok = kv_tokens_for(spec, plan, n)
        run = {"instances": n, "sessions": plan.sessions, "requests": len(plan),
               "plan": plan.name, "scale": plan.scale, "kv_tokens": kv_tok,
               "max_model_len": max_len, "working_set_bytes": sizing.working_set_bytes,
               "input_tokens": int(plan.input_tokens.sum()),
               "reuse_bound_pct": round(plan.reuse_bound(), 2), "configs": {}}
        ctx = RunCtx(spec, plan, sizing, n, max_len, kv_tok)
        run["configs"] = _run_all(ctx, cfgs, ui)
        runs.append(run)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
              "spec": plain(asdict(spec)), "bytes_per_token": bpt, "runs": runs}
    report["targets"] = evaluate(report)
    report["wall_s"] = round(time.time() - t0, 1)
    return report


def _runnable(cfgs: list[Config], ui) -> list[Config]:
    """`cfgs` less the peers that cannot run here (each skipped with its reason: a peer is
    not kvtier's dependency)."""
    out = []
    for cfg in cfgs:
        if cfg.kind == "lmcache":
            from kvtier.tools.bench.lmcache_peer import peers_dir, venv_problem
            problem = venv_problem(peers_dir() / "lmcache")
            if problem:
                ui.say(f"[{cfg.label}] skipped: {problem}")
                continue
        out.append(cfg)
    return out


def _run_all(ctx: RunCtx, cfgs: list[Config], ui) -> dict:
    """Every configuration, in turn or side by side; {label: result}."""
    spec = ctx.spec
    roots = [spec.out / "work" / f"{spec.engine}-n{ctx.n}-{c.label.replace('%', 'pct')}"
             for c in cfgs]
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    t = time.time()
    if spec.side_by_side and spec.engine == "vllm":
        results = run_side_by_side(ctx, cfgs, roots, ui)
        walls = [time.time() - t] * len(cfgs)
    else:
        results, walls = [], []
        for cfg, root in zip(cfgs, roots):
            t = time.time()
            results.append(run_config(ctx, cfg, root, ui))
            walls.append(time.time() - t)
    out = {}
    for cfg, root, (records, extra), wall in zip(cfgs, roots, results, walls):
        out[cfg.label] = _result(ctx, cfg, records, extra, wall)
        for sub in ("nvme", "shared"):  # the blocks: keep the logs, drop the bytes
            for p in root.glob(f"**/{sub}"):
                shutil.rmtree(p, ignore_errors=True)
    return out


def _result(ctx: RunCtx, cfg: Config, records: list[dict], extra: dict, wall: float) -> dict:
    tiers = extra.pop("tier_names")
    summary = summarize(records, tiers, bytes_per_token(ctx.spec.dtype),
                        ctx.spec.chunk_tokens, ctx.kv_tok)
    return {"kind": cfg.kind, "dram_frac": cfg.dram_frac, "tiers": tiers,
            "segment_bytes": ctx.sizing.segment_bytes(cfg.dram_frac) if cfg.pooled else 0,
            "wall_s": round(wall, 1), **summary, **extra,
            "requests": [_rounded(r) for r in records]}


def _rounded(r: dict) -> dict:
    """A request's record for the JSON report (times in ms resolution)."""
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}

