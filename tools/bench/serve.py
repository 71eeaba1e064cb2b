"""`kvtier bench serve`: a new user's worst case, two OpenAI API servers beside a CPU-heavy job.

The README's "Serving with vLLM" setup on the tiny random model: one node policy for both
servers (`a` and `b`: a dram tier of 1 GiB and an nvme tier, one index), one master on its
own, two `vllm.entrypoints.openai.api_server` processes with the kvtier connector
(`tools.api_server`) and `busy` processes keeping a core busy each. With `pool="files"`
(the README's default) each server lends its part of the pool from a file in `/dev/shm`
that the other reads in place; with `pool="embedded"` each lends its own segment and the
other reads it over TCP (the setup of the first worst-case reports).

For each of `requests` fresh prompts of `tokens` tokens, `a` prefills it cold, and `gap_s`
later (an agent's turn) `b` answers it from the cache. TTFT is the wall time of a
one-token greedy completion through the HTTP API. The report gives each request's cold and
hit TTFT, the tokens its hit loaded per tier and recomputed, whether `b`'s token is `a`'s,
P50/P99 of both, and the target: no hit slower than 1.2x the median cold TTFT of the same
run (a hit never costs more than recomputing it).

Where `b`'s token is not `a`'s, the report says whether it is `a`'s runner-up and by how
much `a` preferred its own (the gap between the two log-probabilities). The model is bf16:
a hit computes the prompt's tail in another batch shape than the cold prefill's chunks, so
its log-probabilities move by up to about a tenth, and a prompt whose top two tokens are
that close can flip; vLLM's own prefix cache flips the same prompts (BENCHMARKS.md), and
the bytes a hit loads are the ones `a` saved (every frame's checksum). A token that is not
the runner-up, or one at a wide gap, is what a wrong load would look like.

`pythonpath` runs both servers on another kvtier (an older checkout) to measure it beside
this one; the master stays this one's.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.store.base.config import MasterConfig
from kvtier.tiers.mooncake.master import EmbeddedMaster, free_port
from kvtier.tools.api_server import ApiServer
from kvtier.tools.bench.vllm import p99, spin
from kvtier.tools.vllm_engine import kvtier_transfer_config, make_tiny_model, random_prompt

START_TIMEOUT_S = 900  # two servers starting at once on a small, busy host
TARGET = 1.2  # the worst hit over the median cold
METRICS = ("kvtier_hit_tokens_total", "kvtier_recomputed_tokens_total",
           "kvtier_load_error_blocks_total", "kvtier_load_late_chunks_total")


@dataclass
class ServeSpec:
    requests: int = 20
    tokens: int = 8192
    busy: int = 2
    pool: str = "files"  # files (README default: in place from /dev/shm) or embedded (TCP)
    gap_s: float = 1.0  # between a's answer and b's request: an agent's turn
    pythonpath: str | None = None  # the servers' kvtier, if not this one

    def __post_init__(self):
        if self.pool not in ("files", "embedded"):
            raise ValueError(f"pool must be 'files' or 'embedded', not {self.pool!r}")
        if self.requests < 1 or self.tokens < 256:
            raise ValueError("requests must be at least 1 and tokens at least 256 (one "
                             "chunk of the default policy)")


def node_policy(root: Path, master: str, segment_dir: Path | None) -> dict:
    """The README's policy for the node, on this run's master and directories."""
    dram = {"name": "dram", "kind": "mooncake", "capacity": "1GiB"}
    if segment_dir is not None:
        dram["segment_dir"] = str(segment_dir)
    return {"namespace": {"model": "tiny-llama"}, "index": {"path": str(root / "index")},
            "master": {"address": master, "embedded": False},
            "tiers": [dram, {"name": "nvme", "kind": "nvme", "path": str(root / "nvme"),
                             "capacity": "4GiB"}]}


def _kvtier(body: dict) -> dict:
    return (body.get("kv_transfer_params") or {}).get("kvtier") or {}


def _token(body: dict) -> list[int]:
    return body["choices"][0].get("token_ids") or []


def _top(body: dict) -> list[tuple[int, float]]:
    """The first generated token's top choices, (token id, log-probability), best first."""
    logprobs = body["choices"][0].get("logprobs") or {}
    top = (logprobs.get("top_logprobs") or [None])[0] or {}
    return sorted(((int(k.rsplit(":", 1)[1]), v) for k, v in top.items()),
                  key=lambda kv: -kv[1])


class ServeBench:
    """The two servers, their master and the neighbours' load; see the module docstring."""

    def __init__(self, root: Path, spec: ServeSpec, progress=print):
        self.root, self.spec, self.say = root, spec, progress
        self.master: EmbeddedMaster | None = None
        self.segment_dir = (Path("/dev/shm") / f"kvtier-bench-serve-{os.getpid()}"
                            if spec.pool == "files" else None)
        self.servers: dict[str, ApiServer] = {}

    def start(self) -> None:
        model = make_tiny_model(self.root / "model")
        self.master = EmbeddedMaster(MasterConfig(address=f"127.0.0.1:{free_port()}"),
                                     log_path=self.root / "master.log").start()
        policy = node_policy(self.root, self.master.address, self.segment_dir)
        self.say("starting servers a and b")
        for name in ("a", "b"):
            self.servers[name] = ApiServer(
                model, kvtier_transfer_config(policy, node_id=name),
                self.root / f"server-{name}.log", max_model_len=self.spec.tokens + 256,
                dtype="bfloat16", block_size=None, pythonpath=self.spec.pythonpath)
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in self.servers.values():
            server.wait_ready(deadline)

    def pair(self, seed: int) -> dict:
        """One prompt: cold on a, then a hit on b."""
        prompt = random_prompt(20_000 + seed, self.spec.tokens)
        cold, cold_s = self.servers["a"].complete(prompt, 1, logprobs=2)
        time.sleep(self.spec.gap_s)
        hit, hit_s = self.servers["b"].complete(prompt, 1, logprobs=2)
        info = _kvtier(hit)
        same, top = _token(hit) == _token(cold), _top(cold)
        return {"cold_s": cold_s, "hit_s": hit_s, "hit_tokens": info.get("hit_tokens", {}),
                "recomputed_tokens": info.get("recomputed_tokens"),
                "load_deadlines_ms": info.get("load_deadlines_ms", []),
                "cached_tokens": (hit.get("usage", {}).get("prompt_tokens_details") or {})
                .get("cached_tokens"),
                "same_output": same,
                # where b's token is not a's: a's runner-up, and a's gap between the two
                "runner_up": not same and len(top) > 1 and _token(hit)[:1] == [top[1][0]],
                "cold_margin": round(top[0][1] - top[1][1], 5) if len(top) > 1 else None}

    def run(self) -> list[dict]:
        self.pair(0)  # first requests pay one-time setup costs (b maps a's segment)
        time.sleep(2.0)
        rows = []
        for i in range(1, self.spec.requests + 1):
            rows.append(self.pair(i))
            r = rows[-1]
            deadline = "".join(f", deadline {ms:.0f} ms" for ms in r["load_deadlines_ms"][:1])
            self.say(f"request {i}/{self.spec.requests}: cold {r['cold_s'] * 1e3:.0f} ms, "
                     f"hit {r['hit_s'] * 1e3:.0f} ms{deadline}")
        return rows

    def metrics(self) -> dict[str, float]:
        return {m: self.servers["b"].metric(m) for m in METRICS}

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        if self.master is not None:
            self.master.stop()
        if self.segment_dir is not None:
            shutil.rmtree(self.segment_dir, ignore_errors=True)


def summarize(rows: list[dict]) -> dict:
    """P50/P99 of cold and hit TTFT in ms, the worst hit over the median cold and the
    target, and the tokens the hits loaded and recomputed."""
    cold = [r["cold_s"] * 1e3 for r in rows]
    hit = [r["hit_s"] * 1e3 for r in rows]
    median_cold = statistics.median(cold)
    worst = max(hit) / median_cold
    loaded = sum(sum(r["hit_tokens"].values()) for r in rows)
    recomputed = sum(r["recomputed_tokens"] or 0 for r in rows)
    return {"cold_p50_ms": round(median_cold, 1), "cold_p99_ms": round(p99(cold), 1),
            "hit_p50_ms": round(statistics.median(hit), 1),
            "hit_p99_ms": round(p99(hit), 1),
            "worst_hit_over_median_cold": round(worst, 2), "target": TARGET,
            "ok": worst <= TARGET, "loaded_tokens": loaded, "recomputed_tokens": recomputed,
            "different_outputs": sum(not r["same_output"] for r in rows),
            "different_at_runner_up": sum(bool(r.get("runner_up")) for r in rows)}


def run_serve_bench(spec: ServeSpec, root: Path | None = None, progress=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-") as tmp:
        root = Path(root or tmp)
        root.mkdir(parents=True, exist_ok=True)
        bench = ServeBench(root, spec, progress)
        try:
            bench.start()
            with spin(spec.busy):
                rows = bench.run()
            metrics = bench.metrics()
        finally:
            bench.close()
    return {"spec": asdict(spec), "requests": rows, "summary": summarize(rows),
            "metrics_b": metrics}
