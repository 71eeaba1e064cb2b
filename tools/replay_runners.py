"""Run one configuration of an engine replay: set its cluster up, replay, tear it down.

`run_config(...) -> (records, extra)`: `records` as `tools.replay_metrics` reads them;
`extra` carries `tier_names` (the kvtier tiers, fastest first) and what the tiers hold at
the end (`held`, per tier): for real engines, what the nodes' indexes hold once the engines
exited (the pool's blocks live in the engines' segments and leave with them, so only nvme
and shared remain); for simulated instances, bytes held and written before they close. `vllm` replays in real time against
real engines (`tools.replay_vllm` + `tools.replay_live`); `sim` in virtual time against
simulated instances over a real store (`tools.replay_sim`), with the calibrated model.
"""

from __future__ import annotations

import threading
from pathlib import Path

from kvtier.store.config import MasterConfig
from kvtier.store.keys import Namespace
from kvtier.store.master import EmbeddedMaster, free_port
from kvtier.tools.replay_cluster import Config, Sizing, node_policy
from kvtier.tools.replay_plan import Plan
from kvtier.tools.replay_router import make_router

TIER_KINDS = {"dram": "mooncake", "nvme": "nvme", "shared": "sharedfs"}


def tier_names(cfg: Config) -> list[str]:
    return {"kvtier": ["dram", "nvme", "shared"], "dram-only": ["dram"],
            "local": []}[cfg.kind]


def run_config(spec, cfg: Config, plan: Plan, sizing: Sizing, n: int, max_len: int,
               kv_tok: int, root: Path, ui) -> tuple[list[dict], dict]:
    if spec.engine == "vllm":
        return _run_vllm(spec, cfg, plan, sizing, n, max_len, kv_tok, root, ui)
    return _run_sim(spec, cfg, plan, sizing, n, kv_tok, root, ui)


def _run_vllm(spec, cfg, plan, sizing, n, max_len, kv_tok, root, ui):
    from kvtier.tools.replay_engine_run import model_dir
    from kvtier.tools.replay_live import run_live
    from kvtier.tools.replay_vllm import VllmCluster
    from kvtier.tools.vllm_engine import make_tiny_model
    model = make_tiny_model(model_dir())
    cluster = VllmCluster(root, cfg, n, model, sizing, chunk_tokens=spec.chunk_tokens,
                          # vLLM keeps one block back (the null block)
                          block_size=32, num_blocks=kv_tok // 32 + 1, max_model_len=max_len,
                          dtype=spec.dtype, eviction=spec.eviction,
                          admission=spec.admission, say=ui.say)
    try:
        ui.say(f"[{cfg.label}] replaying {len(plan)} requests on {n} engines")
        records = run_live(plan, cluster.backends(plan), make_router(spec.router, n),
                           spec.speed, spec.max_batch, ui.update)
    finally:
        cluster.close()
    return records, {"tier_names": tier_names(cfg), "held": cluster.held()}


def _run_sim(spec, cfg, plan, sizing, n, kv_tok, root, ui):
    from kvtier.tools.replay_model import Calibration
    from kvtier.tools.replay_sim import SimRun
    cal = Calibration.load(spec.calibration)
    master, workers = None, [None] * n
    try:
        if cfg.uses_store:
            mcfg = MasterConfig(address=f"127.0.0.1:{free_port()}")
            master = EmbeddedMaster(mcfg, log_path=root / "master.log").start()
            ui.say(f"[{cfg.label}] starting {n} simulated instances")
            workers = _start_workers(root, cfg, sizing, n, mcfg.address, spec)
        ns = Namespace(model="tiny-llama-sim", dtype=spec.dtype, block_size=32,
                       chunk_tokens=spec.chunk_tokens)
        sim = SimRun(plan, workers, make_router(spec.router, n), cal.model, TIER_KINDS,
                     kv_tok // plan.block_tokens, ns.fingerprint(), sizing.block_bytes,
                     spec.speed)
        records = sim.run(ui.update)
        usage = [w.call("usage") for w in workers if w is not None]
    finally:
        for w in workers:
            if w is not None:
                w.close()
        if master is not None:
            master.stop()
    return records, {"tier_names": tier_names(cfg), "held": _held(usage),
                     "model": cal.model.describe(), "calibration": cal.source}


def _start_workers(root, cfg, sizing, n, address, spec):
    from kvtier.tools.replay_sim_worker import SimWorker
    workers = []
    try:
        for k in range(n):
            pol = node_policy(root, f"n{k}", address, cfg, sizing, spec.chunk_tokens,
                              spec.eviction, spec.admission)
            workers.append(SimWorker(pol, f"n{k}", sizing.block_bytes,
                                     str(root / f"instance-n{k}.log")))
        errors: list[BaseException] = []

        def ready(w) -> None:
            try:
                w.ready()
            except BaseException as e:  # re-raised below, on the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=ready, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
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
