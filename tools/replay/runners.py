"""Run configurations of an engine replay: set each cluster up, replay, tear it down.

`run_config(ctx, cfg, root, ui) -> (records, extra)`: `records` as `tools.replay.metrics`
reads them; `extra` carries `tier_names` (the kvtier tiers, fastest first) and what the
tiers hold at the end (`held`, per tier): for real engines, what the nodes' indexes hold once
the engines exited (nvme and shared: an index records no pool blocks, the master does); for
simulated instances, bytes held and written before they close. `vllm` replays in real time
against real engines (`tools.replay.vllm_cluster` + `tools.replay.live`); `sim` in virtual time
against simulated instances over a real store (`tools.replay.sim`), with the calibrated model.

`run_side_by_side(ctx, cfgs, roots, ui)` (real engines only) runs every configuration at the
same time, each on its own engines and cluster, each with its own copy of the request
stream: on a machine shared with other jobs, background load then hits every configuration
alike. They also compete with each other for the CPUs, which slows the faster configuration
most (the busy baseline takes CPU from it while it still has work, and has the machine to
itself once it is done): the comparison is conservative for the faster one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.store.base.config import MasterConfig
from kvtier.store.base.keys import Namespace
from kvtier.tiers.mooncake.master import EmbeddedMaster, free_port
from kvtier.tools.replay.cluster import Config, Sizing, node_policy, pool_split
from kvtier.tools.replay.plan import Plan
from kvtier.tools.replay.router import make_router
from kvtier.tools.threads import in_threads

TIER_KINDS = {"dram": "mooncake", "nvme": "nvme", "shared": "sharedfs"}


@dataclass(frozen=True)
class RunCtx:
    spec: object          # tools.replay.experiment.EngineSpec
    plan: Plan
    sizing: Sizing
    n: int
    max_len: int
    kv_tok: int


def tier_names(cfg: Config) -> list[str]:
    return {"kvtier": ["dram", "nvme", "shared"], "dram-only": ["dram"]}.get(cfg.kind, [])


def run_config(ctx: RunCtx, cfg: Config, root: Path, ui) -> tuple[list[dict], dict]:
    update = ui.phase(f"{cfg.label} ({ctx.n} instances)", len(ctx.plan))
    if ctx.spec.engine == "sim":
        return _run_sim(ctx, cfg, root, ui, update)
    cluster = _vllm_cluster(ctx, cfg, root, ui).start()
    try:
        records = _replay_vllm(ctx, cfg, cluster, ui, update)
    finally:
        cluster.close()
    extra = _cluster_extra(cfg, cluster)
    if (split := cluster.pool_split()) is not None:
        extra["pool_hits_by_host"] = split
    return records, extra


def run_side_by_side(ctx: RunCtx, cfgs: list[Config], roots: list[Path], ui) -> list[tuple]:
    """Every configuration at once (see the module docstring); results in `cfgs` order."""
    clusters: list = []
    updates = [ui.phase(f"{c.label} ({ctx.n} instances)", len(ctx.plan)) for c in cfgs]
    try:
        # masters start here, on this thread (they die with the thread that started them)
        for cfg, root in zip(cfgs, roots):
            clusters.append(_vllm_cluster(ctx, cfg, root, ui, len(cfgs)))
        in_threads([c.start for c in clusters])
        records: list = [None] * len(cfgs)
        in_threads([lambda k=k: records.__setitem__(k, _replay_vllm(
            ctx, cfgs[k], clusters[k], ui, updates[k])) for k in range(len(cfgs))])
    finally:
        for c in clusters:
            c.close()
    return [(records[k], _cluster_extra(cfgs[k], clusters[k])) for k in range(len(cfgs))]


def _cluster_extra(cfg: Config, cluster) -> dict:
    """What a configuration's report says of its cluster: its tiers, what each node's index
    held at the end and, for kvtier's, how the engines shared the pool (`--pool auto`
    picks per run)."""
    extra = {"tier_names": tier_names(cfg), "held": cluster.held()}
    if cfg.uses_store:
        extra["pool"] = cluster.pool
    return extra


def _vllm_cluster(ctx: RunCtx, cfg: Config, root: Path, ui, clusters: int = 1):
    from kvtier.tools.vllm_engine import model_dir
    from kvtier.tools.replay.vllm_cluster import VllmCluster
    from kvtier.tools.vllm_engine import make_tiny_model
    spec = ctx.spec
    return VllmCluster(root, cfg, ctx.n, make_tiny_model(model_dir()), ctx.sizing,
                       # vLLM keeps one block back (the null block)
                       chunk_tokens=spec.chunk_tokens, block_size=32,
                       num_blocks=ctx.kv_tok // 32 + 1, max_model_len=ctx.max_len,
                       dtype=spec.dtype, eviction=spec.eviction, admission=spec.admission,
                       engines_alongside=clusters, pool=spec.pool,
                       inproc=not spec.multiproc, hosts=spec.hosts,
                       shared_fs=spec.shared_fs, say=ui.say)


def _replay_vllm(ctx: RunCtx, cfg: Config, cluster, ui, update) -> list[dict]:
    from kvtier.tools.replay.live import run_live
    ui.say(f"[{cfg.label}] replaying {len(ctx.plan)} requests on {ctx.n} engines")
    return run_live(ctx.plan, cluster.backends(ctx.plan), make_router(ctx.spec.router, ctx.n),
                    ctx.spec.speed, ctx.spec.max_batch, update)


def _run_sim(ctx: RunCtx, cfg: Config, root: Path, ui, update):
    from kvtier.tools.replay.prefill_model import Calibration
    from kvtier.tools.replay.sim import SimRun
    spec, n = ctx.spec, ctx.n
    cal = Calibration.load(spec.calibration)
    master, workers, hosts = None, [None] * n, None
    try:
        if cfg.uses_store and spec.hosts > 1:
            from kvtier.tools.hosts.cluster import HostCluster
            hosts = HostCluster.for_engines(spec.hosts, root / "hosts", spec.shared_fs)
            address = hosts.master_address
            ui.say(f"[{cfg.label}] starting {n} simulated instances on {spec.hosts} hosts")
            workers = _start_workers(root, cfg, ctx.sizing, n, address, spec,
                                     [hosts.hosts.names[k % spec.hosts] for k in range(n)],
                                     [hosts.shared_of(k % spec.hosts) for k in range(n)])
        elif cfg.uses_store:
            mcfg = MasterConfig(address=f"127.0.0.1:{free_port()}")
            master = EmbeddedMaster(mcfg, log_path=root / "master.log").start()
            ui.say(f"[{cfg.label}] starting {n} simulated instances")
            workers = _start_workers(root, cfg, ctx.sizing, n, mcfg.address, spec)
        ns = Namespace(model="tiny-llama-sim", dtype=spec.dtype, block_size=32,
                       chunk_tokens=spec.chunk_tokens)
        sim = SimRun(ctx.plan, workers, make_router(spec.router, n), cal.model, TIER_KINDS,
                     ctx.kv_tok // ctx.plan.block_tokens, ns.fingerprint(),
                     ctx.sizing.block_bytes, spec.speed)
        records = sim.run(update)
        usage = [w.call("usage") for w in workers if w is not None]
    finally:
        for w in workers:
            if w is not None:
                w.close()
        if master is not None:
            master.stop()
        if hosts is not None:
            hosts.close()
    extra = {"tier_names": tier_names(cfg), "held": _held(usage),
             "model": cal.model.describe(), "calibration": cal.source}
    if hosts is not None:
        extra["pool_hits_by_host"] = pool_split([u["tiers"]["dram"] for u in usage])
    return records, extra


def _start_workers(root, cfg, sizing, n, address, spec, hosts=None, shared=None):
    """`hosts[k]`: the network namespace instance k runs in (None: this one); `shared[k]`
    its shared dir (None: the replay's one)."""
    from kvtier.tools.replay.sim_worker import SimWorker
    workers = []
    try:
        for k in range(n):
            pol = node_policy(root, f"n{k}", address, cfg, sizing, spec.chunk_tokens,
                              spec.eviction, spec.admission, count_hosts=bool(hosts),
                              shared=shared[k] if shared else None)
            workers.append(SimWorker(pol, f"n{k}", sizing.block_bytes,
                                     str(root / f"instance-n{k}.log"),
                                     hosts[k] if hosts else None))
        in_threads([w.ready for w in workers])
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def _held(usage: list[dict]) -> dict[str, dict[str, int]]:
    """Bytes each tier holds at the end and wrote during the run, summed over instances."""
    out: dict[str, dict[str, int]] = {}
    for u in usage:
        for name, t in u["tiers"].items():
            agg = out.setdefault(name, {"bytes": 0, "bytes_written": 0})
            agg["bytes"] += t["used_bytes"]
            agg["bytes_written"] += t.get("bytes_in", 0)
    return out
