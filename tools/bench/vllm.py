"""`kvtier bench vllm`: time to first token on real vLLM engines, by where the prefix comes from.

Two engine processes with the kvtier connector (nodes `a` and `b`: own index and nvme dir,
one shared dir, one embedded `mooncake_master`) serve the tiny random model of
`model_kind` (llama, mla, swa, and the recurrent hybrids hybrid, nemotronh, qwen3next).
The bytes one token takes in the store are summed over the stored frames of every KV cache
group. (On the MLA and recurrent models vLLM's CPU build keeps no prefix cache of its own:
`local` is a hit from kvtier on the same node.) A recurrent hybrid's hit ends only where a
stored state is, at the end of a prompt computed before: its hits are the next turn, the
prompt and 32 new tokens. For each prompt size, with fresh random prompts per measurement:

- cold: `a` prefills a prompt nobody has seen (connector on: lookup miss, saves);
- local: `a` again, the same prompt (vLLM's own prefix cache), once `a`'s saves and the
  mover's copies to nvme/sharedfs are done (so no background work runs beside it);
- dram: `b`, the same prompt (a remote hit from the pool);
- then, for a second set of prompts computed by `a` and persisted: the pool is wiped (the
  master restarted) and prefix caches reset; shared: `b` (its nvme never saw them);
  nvme: `a` (its node's nvme). `mover.promote_on_hit` is off so a read does not lift the
  blocks into the pool before the next tier is measured.

TTFT is the wall time of a one-token greedy `generate` inside the engine process (prefill,
load, first sample); each case is reported as the median and the best of its repeats (on a
shared machine interference only adds time). Every hit is checked against the tier the
connector reports.
The connector's targets: dram within 1.5x of local; at 16K tokens dram at least 20x faster than
cold; and the worst case: no dram hit slower than 1.2x the median cold prefill (a hit never
costs more than recomputing it). `busy` spins that many processes beside the engines.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from kvtier.store.base import block
from kvtier.store.base.keys import NS_HEX, chunk_hashes, end_key, make_keys
from kvtier.store.base.config import MasterConfig
from kvtier.tiers.mooncake.master import EmbeddedMaster, free_port
from kvtier.tools.vllm_engine import (BLOCK_SIZE, ENGINE_ARGS, MODEL_KINDS, RECURRENT_KINDS,
                                      Engine, kvtier_transfer_config, logged_namespaces,
                                      make_tiny_model, prompt_keys, random_prompt)

CASES = ("cold", "local", "dram", "nvme", "shared")
EXPECTED_TIER = {"dram": "dram", "nvme": "nvme", "shared": "shared"}


@dataclass
class BenchSpec:
    sizes: tuple[int, ...] = (4096, 8192, 16384)
    repeats: int = 3
    chunk_tokens: int = 32  # = block_size: a hit as fine-grained as vLLM's own prefix cache
    block_size: int = 32
    dtype: str = "bfloat16"
    inproc: bool = True
    # "files": each engine lends its segment from a /dev/shm file the other engine reads
    # straight out of (`segment_dir`; the fastest remote hit, BENCHMARKS.md);
    # "service": both engines join one pool service (the node's segment, shared memory);
    # "embedded": each engine lends its own segment and reads the other's over TCP.
    pool: str = "files"
    load: str = "async"  # the connector's `load` setting (async, sync, auto)
    busy: int = 0  # processes spinning a core each beside the engines (a CPU-heavy job)
    # the tiny model's architecture (`tiny_models`): llama, mla (DeepSeek-V2 shape, its own
    # block size 16), swa (Gemma 3 shape, sliding window beside full attention), hybrid
    # (Granite 4.0-H shape, a Mamba2 layer beside full attention), nemotronh, qwen3next
    model_kind: str = "llama"
    # vLLM's hybrid memory allocator (off: one KV cache group, every layer for every token)
    hybrid_allocator: bool = True

    def __post_init__(self):
        if self.model_kind not in MODEL_KINDS:
            raise ValueError(f"model kind must be one of {', '.join(MODEL_KINDS)}, not "
                             f"{self.model_kind!r}")
        if self.model_kind != "llama":  # the kind's own block size (CPU_MLA takes 16 only)
            self.block_size = BLOCK_SIZE[self.model_kind]
            self.chunk_tokens = max(self.chunk_tokens, self.block_size)
        # a kind whose CPU kernels take one dtype only (the Qwen3-Next shape: bfloat16)
        self.dtype = ENGINE_ARGS[self.model_kind].get("dtype", self.dtype)


@dataclass
class Result:
    size: int
    ttft_s: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CASES})
    tier_mismatches: list[str] = field(default_factory=list)

    def median_ms(self, case: str) -> float | None:
        v = self.ttft_s[case]
        return statistics.median(v) * 1e3 if v else None

    def p99_ms(self, case: str) -> float | None:
        """The tail a user feels: the 99th percentile of the repeats (the worst of fewer
        than 100)."""
        v = self.ttft_s[case]
        return p99(v) * 1e3 if v else None

    def min_ms(self, case: str) -> float | None:
        """The best of the repeats: on a shared machine, interference only adds time."""
        v = self.ttft_s[case]
        return min(v) * 1e3 if v else None


def p99(values: list[float]) -> float:
    """The 99th percentile of `values` by nearest rank: the worst of fewer than 100."""
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))]


def node_policy(root: Path, node: str, master: str, spec: BenchSpec,
                service: str | None = None, segment_dir: Path | None = None) -> dict:
    dram = {"name": "dram", "kind": "mooncake", "capacity": "1GiB", "buffer": "128MiB",
            "staging": "128MiB"}
    if segment_dir:
        dram["segment_dir"] = str(segment_dir)
    if service:
        dram |= {"capacity": "2GiB", "service": service, "service_embedded": False}
    return {"namespace": {"model": f"tiny-{spec.model_kind}"}, "chunk_tokens": spec.chunk_tokens,
            "index": {"path": str(root / node / "index"), "map_size": "256MiB"},
            # One run dir for the node: where its pool service names its segment.
            "master": {"address": master, "embedded": False, "run_dir": str(root / "run")},
            "admission": {"kind": "always"}, "mover": {"promote_on_hit": False},
            "tiers": [
                dram,
                {"name": "nvme", "kind": "nvme", "path": str(root / node / "nvme"),
                 "capacity": "4GiB"},
                {"name": "shared", "kind": "sharedfs", "path": str(root / "shared"),
                 "capacity": "8GiB"}]}


class Bench:
    def __init__(self, root: Path, spec: BenchSpec, progress=print):
        self.root, self.spec, self.say = root, spec, progress
        self.model = make_tiny_model(root / "model", spec.model_kind)
        self.master_cfg = MasterConfig(address=f"127.0.0.1:{free_port()}",
                                       run_dir=root / "run")
        self.master = EmbeddedMaster(self.master_cfg, log_path=root / "master.log").start()
        self.service = None
        if spec.pool == "service":
            from kvtier.store.base.config import policy_from_dict
            from kvtier.tiers.mooncake.service import PoolService
            address = f"127.0.0.1:{free_port()}"
            dram = policy_from_dict(node_policy(root, "a", self.master_cfg.address, spec,
                                                address)).tiers[0]
            self.service = PoolService(dram, self.master_cfg).start()
        elif spec.pool not in ("embedded", "files"):
            raise ValueError(f"pool must be 'service', 'embedded' or 'files', not "
                             f"{spec.pool!r}")
        self.segment_dir = (Path("/dev/shm") / f"kvtier-bench-{os.getpid()}"
                            if spec.pool == "files" else None)
        self.engines: dict[str, Engine] = {}
        self.seed = 0
        self.first_remote_s = 0.0  # b's first hit on a's blocks (a setup cost, not measured)

    def policy(self, node: str) -> dict:
        return node_policy(self.root, node, self.master_cfg.address, self.spec,
                           self.service.address if self.service else None, self.segment_dir)

    def start(self) -> None:
        for node in ("a", "b"):
            self.say(f"starting engine {node}")
            self.engines[node] = Engine(
                self.model, self.root / f"engine-{node}.log",
                kv_transfer_config=kvtier_transfer_config(self.policy(node), node_id=node,
                                                          load=self.spec.load),
                block_size=self.spec.block_size, dtype=self.spec.dtype,
                max_model_len=max(self.spec.sizes) + 256, inproc=self.spec.inproc,
                engine_args=self.engine_args())
        for engine in self.engines.values():  # first requests pay one-time setup costs
            for n in (512, min(self.spec.sizes)):
                engine.generate([self.prompt(n)], 1)
        # and so does b's first remote hit: it maps a's pool segment (with `--pool files`,
        # ~0.1 s, then its pages in the background, ~0.4 s of CPU per GiB)
        warm = self.prompt(min(self.spec.sizes))
        self.engines["a"].generate([warm], 1)
        self.wait_persisted([warm])
        _, self.first_remote_s = self.engines["b"].generate([warm], 1)
        time.sleep(2.0)

    def prompt(self, n: int) -> list[int]:
        self.seed += 1
        return random_prompt(10_000 + self.seed, n)

    def turn(self, prompt: list[int]) -> list[int]:
        """The prompt a hit on `prompt` is measured with: itself, or for a recurrent hybrid
        (whose hits end where a state was stored) the next turn: it and 32 new tokens."""
        if self.spec.model_kind not in RECURRENT_KINDS:
            return prompt
        return prompt + random_prompt(len(prompt) * 7 + prompt[0], 32)

    def ttft(self, node: str, prompt: list[int], case: str, res: Result) -> None:
        if case != "cold":
            prompt = self.turn(prompt)
        outs, elapsed = self.engines[node].generate([prompt], 1)
        res.ttft_s[case].append(elapsed)
        hits = (outs[0].kv_transfer_params or {}).get("kvtier", {}).get("hit_tokens", {})
        want = EXPECTED_TIER.get(case)
        if (want is None and case == "cold" and hits) or (want and set(hits) != {want}):
            res.tier_mismatches.append(f"{case}@{res.size}: hits {hits}")

    def wait_persisted(self, prompts: list[list[int]], timeout_s: float = 120) -> None:
        """Until the shared tier holds every chunk of `prompts` (the mover is done)."""
        from kvtier.store.base.config import policy_from_dict
        from kvtier.store.tiered import TieredStore
        probe = self.policy("probe")
        probe["tiers"] = [t for t in probe["tiers"] if t["kind"] == "sharedfs"]
        keys = [k for p in prompts for k in self.keys_of(p, probe) + self.end_keys_of(p, probe)]
        with TieredStore(policy_from_dict(probe), node_id="probe", mover=False) as store:
            deadline = time.monotonic() + timeout_s
            while store.lookup(keys).hit_blocks < len(keys):
                if time.monotonic() > deadline:
                    raise TimeoutError("the mover did not persist the prompts to sharedfs in "
                                       f"{timeout_s:.0f}s; see {self.root}/engine-a.log")
                time.sleep(0.2)

    def engine_args(self) -> dict:
        args = dict(ENGINE_ARGS[self.spec.model_kind])
        if not self.spec.hybrid_allocator:
            args["disable_hybrid_kv_cache_manager"] = True
        return args

    def keys_of(self, prompt: list[int], policy: dict) -> list[str]:
        if self.spec.model_kind in RECURRENT_KINDS:  # named as engine a's connector said
            return make_keys(self.namespaces()["full"][0],
                             chunk_hashes(prompt, self.spec.chunk_tokens))
        return prompt_keys(prompt, policy, self.spec.dtype, self.spec.block_size,
                           self.spec.model_kind, hybrid=self.spec.hybrid_allocator)

    def namespaces(self) -> dict[str, list[str]]:
        """{group kind: namespace fingerprints} from engine a's connector start lines."""
        out = logged_namespaces((self.root / "engine-a.log").read_text(errors="replace"))
        if "full" not in out or "state" not in out:
            raise RuntimeError(f"no attention and recurrent groups in the connector's start "
                               f"lines of {self.root}/engine-a.log: is the model a hybrid?")
        return out

    def end_keys_of(self, prompt: list[int], policy: dict) -> list[str]:
        """A recurrent hybrid's frames stored at the end of `prompt`: the state of each
        recurrent group and, inside a chunk, the attention part-chunk (none otherwise)."""
        if self.spec.model_kind not in RECURRENT_KINDS:
            return []
        from kvtier.connector.naming import rank_keys
        spaces = self.namespaces()
        key = end_key(spaces["full"][0], prompt, self.spec.chunk_tokens)
        tail = [key] if len(prompt) % self.spec.chunk_tokens else []
        return [rank_keys([key], fp)[0] for fp in spaces["state"]] + tail

    def stored_bytes_per_token(self) -> float:
        """Bytes one token of a prompt takes in the store, frame headers included: every
        frame in the shared tier (of every KV cache group) over the tokens of the chunks of
        the group a hit's prefix is keyed by (a sliding-window group keeps fewer chunks)."""
        prefix = self.keys_of([0] * self.spec.chunk_tokens, self.policy("probe"))[0][:NS_HEX]
        total, chunks = 0, 0
        for path in (self.root / "shared").rglob("*.kvb"):
            header = block.parse_header(path.read_bytes()[:block.HEADER_SIZE])
            total += header.frame_len
            chunks += header.key.startswith(prefix)
        return round(total / (chunks * self.spec.chunk_tokens), 1) if chunks else 0.0

    def run(self) -> list[Result]:
        results = {n: Result(n) for n in self.spec.sizes}
        disk: list[tuple[int, list[int]]] = []
        for n in self.spec.sizes:
            for r in range(self.spec.repeats):
                self.say(f"{n} tokens, round {r + 1}: cold, local, dram")
                p = self.prompt(n)
                self.ttft("a", p, "cold", results[n])
                self.wait_persisted([p])  # a's saves and moves are done: nothing runs beside
                self.ttft("a", p, "local", results[n])
                self.ttft("b", p, "dram", results[n])
                q = self.prompt(n)
                self.ttft("a", q, "cold", results[n])
                disk.append((n, q))
        self.wait_persisted([q for _, q in disk])
        self.say("wiping the pool (master restart); reading from shared, then nvme")
        self.master.stop()
        self.master = EmbeddedMaster(self.master_cfg, log_path=self.root / "master2.log").start()
        for engine in self.engines.values():
            engine.reset_prefix_cache()
        # no wait: the engines' clients recover from the restart in the background, and
        # a read right after it must not pay for that
        for n, q in disk:
            self.ttft("b", q, "shared", results[n])
        for n, q in disk:
            self.ttft("a", q, "nvme", results[n])
        return [results[n] for n in self.spec.sizes]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        if self.service is not None:
            self.service.stop()
        self.master.stop()
        if self.segment_dir is not None:
            shutil.rmtree(self.segment_dir, ignore_errors=True)


def targets(results: list[Result]) -> list[dict]:
    """The connector's targets, on the medians and on the best of the repeats."""
    out = []
    for res in results:
        for stat in ("median", "min"):
            local, dram, cold = (getattr(res, f"{stat}_ms")(c) for c in ("local", "dram", "cold"))
            if local and dram:
                out.append({"size": res.size, "stat": stat, "what": "dram / local <= 1.5",
                            "value": round(dram / local, 2), "ok": dram / local <= 1.5})
            if stat == "median" and cold and res.ttft_s["dram"]:
                worst = max(res.ttft_s["dram"]) * 1e3
                out.append({"size": res.size, "stat": "max", "what": "dram / median cold <= 1.2",
                            "value": round(worst / cold, 2), "ok": worst / cold <= 1.2})
            if res.size >= 16384 and cold and dram:
                out.append({"size": res.size, "stat": stat, "what": "cold / dram >= 20",
                            "value": round(cold / dram, 1), "ok": cold / dram >= 20})
    return out


@contextmanager
def spin(n: int) -> Iterator[None]:
    """`n` processes that each keep a core busy (what a CPU-heavy job beside a server does),
    killed on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_bench(spec: BenchSpec, root: Path | None = None, progress=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        bench = Bench(Path(root or tmp), spec, progress)
        try:
            bench.start()
            with spin(spec.busy):
                results = bench.run()
            per_token = bench.stored_bytes_per_token()
        finally:
            bench.close()
    return {"spec": asdict(spec), "first_remote_hit_ms": round(bench.first_remote_s * 1e3, 1),
            "stored_bytes_per_token": per_token,
            "results": [
        asdict(r) | {"median_ms": {c: r.median_ms(c) for c in CASES},
                     "min_ms": {c: r.min_ms(c) for c in CASES},
                     "p99_ms": {c: r.p99_ms(c) for c in CASES}} for r in results],
        "targets": targets(results)}
