"""`kvtier replay --calibrate`: measure the tiny engine once, fit the sim's prefill model.

Three engine processes (the tiny random model, the kvtier connector, one cluster) are
measured one request at a time, each TTFT taken inside the engine (vLLM's request metrics):
- `b` (tiers: dram): cold prefills of fresh prompts (compute rows: new = n, cached = 0),
  the same prompts extended by fresh tokens (local prefix hits: new = m, cached = c), the
  decode rate (65 vs 1 generated tokens), and, after `reset_prefix_cache`, the extended
  prompt again: the prefix comes from the pool (load rows of kind `mooncake`);
- `a` (tiers: nvme, shared) computes prompts; after a reset, it reads them back from its
  nvme (kind `nvme`); `s` (tier: shared only) reads what `a` persisted (kind `sharedfs`).
Each point is the median of its repeats: on a machine shared with other jobs, single
samples vary 2-3x with their load (the file records the load average). A load sample
counts only if the connector reports at least 90% of the prefix from the
expected tier (a save still in flight would otherwise look like a compute row). Nothing is
timed while the engine's own saves of the previous request still run (they share the CPUs):
the model is the cost of the request itself.
`tools.replay.prefill_model.fit` turns the rows into the model; the file records date and machine.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from kvtier.store.base.config import MasterConfig
from kvtier.tiers.mooncake.master import EmbeddedMaster, free_port
from kvtier.tools.replay.prefill_model import Calibration, fit
from kvtier.tools.threads import in_threads
from kvtier.tools.vllm_engine import (Engine, kvtier_transfer_config, make_tiny_model,
                                      random_prompt)

SIZES = (512, 1024, 2048, 4096, 8192, 12288)
EXTEND = ((1024, 64), (1024, 1024), (4096, 64), (4096, 1024), (8192, 64), (8192, 2048))
EXPECT = {"b": ("dram", "mooncake"), "a": ("nvme", "nvme"), "s": ("shared", "sharedfs")}


class _Cal:
    def __init__(self, root: Path, dtype: str, say):
        self.root, self.dtype, self.say, self.seed = root, dtype, say, 0
        self.master = EmbeddedMaster(MasterConfig(address=f"127.0.0.1:{free_port()}"),
                                     log_path=root / "master.log").start()
        self.engines: dict[str, Engine] = {}
        self.rows: dict = {"compute": [], "load": {}}

    def policy(self, node: str, tiers: list[str]) -> dict:
        all_tiers = {
            "dram": {"name": "dram", "kind": "mooncake", "capacity": "256MiB",
                     "buffer": "32MiB", "staging": "32MiB"},
            "nvme": {"name": "nvme", "kind": "nvme", "path": str(self.root / node / "nvme"),
                     "capacity": "512MiB", "region_size": "4MiB"},
            "shared": {"name": "shared", "kind": "sharedfs",
                       "path": str(self.root / "shared"), "capacity": "1GiB"}}
        return {"namespace": {"model": "tiny-llama"}, "chunk_tokens": 32,
                "index": {"path": str(self.root / node / "index"), "map_size": "64MiB"},
                "master": {"address": self.master.address, "embedded": False},
                "admission": {"kind": "always"}, "mover": {"promote_on_hit": False},
                "tiers": [all_tiers[t] for t in tiers]}

    def start(self, model: Path) -> None:
        nodes = {"b": ["dram"], "a": ["nvme", "shared"], "s": ["shared"]}

        def one(node: str) -> None:
            self.engines[node] = Engine(
                model, self.root / f"engine-{node}.log", dtype=self.dtype,
                kv_transfer_config=kvtier_transfer_config(self.policy(node, nodes[node]),
                                                          node_id=node),
                max_model_len=16384, engine_args={"disable_log_stats": False})
            self.engines[node].generate([self.prompt(256)], 1)

        in_threads([lambda n=n: one(n) for n in nodes])

    def prompt(self, n: int) -> list[int]:
        self.seed += 1
        return random_prompt(50_000 + self.seed, n)

    def ttft(self, node: str, prompt: list[int]) -> tuple[float, dict]:
        """TTFT inside the engine (vLLM's request metrics) and the kvtier hits."""
        outs, elapsed = self.engines[node].generate([prompt], 1)
        hits = (outs[0].kv_transfer_params or {}).get("kvtier", {}).get("hit_tokens", {})
        return (outs[0].ttft_s or elapsed), hits

    def load_sample(self, node: str, prompt: list[int], m: int) -> None:
        self.engines[node].reset_prefix_cache()
        secs, hits = self.ttft(node, prompt + self.prompt(m))
        tier, kind = EXPECT[node]
        c = len(prompt) // 32 * 32
        if hits.get(tier, 0) >= 0.9 * c:
            self.rows["load"].setdefault(kind, []).append((m + len(prompt) - hits[tier],
                                                           hits[tier], secs))
        else:
            self.say(f"  skipped a {tier} sample: hits {hits} (a save still in flight?)")

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        self.master.stop()


def _measure(cal: _Cal, repeats: int) -> None:
    for n in SIZES:
        cal.say(f"cold prefill, {n} tokens")
        for _ in range(repeats):
            cal.rows["compute"].append((n, 0, cal.ttft("b", cal.prompt(n))[0]))
            time.sleep(0.1 + n / 20_000)  # its saves land before the next is timed
    for c, m in EXTEND:
        cal.say(f"local hit of {c} tokens + {m} new; loads from dram, nvme, shared")
        for _ in range(repeats):
            p, q = cal.prompt(c), cal.prompt(c)
            cal.ttft("b", p)
            cal.ttft("a", q)
            time.sleep(1.5)  # the saves and the mover's persist land before anything is timed
            cal.rows["compute"].append((m, c, cal.ttft("b", p + cal.prompt(m))[0]))
            cal.load_sample("b", p, m)
            cal.load_sample("a", q, m)
            cal.load_sample("s", q, m)
    p = cal.prompt(2048)
    cal.ttft("b", p)
    one = statistics.median(cal.engines["b"].generate([p], 1)[1] for _ in range(repeats))
    many = statistics.median(cal.engines["b"].generate([p], 65)[1] for _ in range(repeats))
    cal.rows["decode_s"] = max(0.0, (many - one) / 64)


def calibrate(dtype: str = "bfloat16", repeats: int = 5, say=print) -> Calibration:
    """Measure and fit; the caller saves the result (`Calibration.save`)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-calibrate-") as tmp:
        root = Path(tmp)
        from kvtier.tools.vllm_engine import model_dir
        model = make_tiny_model(model_dir())
        cal = _Cal(root, dtype, say)
        try:
            say("starting 3 engines (b: dram, a: nvme+shared, s: shared)")
            cal.start(model)
            _measure(cal, repeats)
        finally:
            cal.close()
    rows = {"compute": _medians(cal.rows["compute"]), "decode_s": cal.rows["decode_s"],
            "load": {k: _medians(v) for k, v in cal.rows["load"].items()}}
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "engine": f"vllm tiny random llama {dtype}, block 32, chunk 32",
            "load_average": os.getloadavg()[0], "points": rows, "samples": cal.rows}
    return Calibration(fit(rows), "measured now", info)


def _medians(rows: list) -> list:
    """One row per measured point (the median of its repeats): one slow sample on a shared
    machine must not bend the fit."""
    groups: dict = {}
    for new, cached, secs in rows:
        groups.setdefault((new, cached), []).append(secs)
    return [(n, c, statistics.median(v)) for (n, c), v in sorted(groups.items())]
