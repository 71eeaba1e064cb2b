"""`kvtier bench vllm --peers`: kvtier beside other KV connectors, same engines, same prompts.

Every system (`peer_systems`: kvtier, the peers asked for, vLLM alone) serves the same tiny
random Llama with the same block size (32) and dtype. For each prompt size and round, one
fresh random prompt goes through every system in turn, the order rotating by round (so no
system always runs first, or right after another's saves):

- cold: `a` prefills the prompt (a lookup miss; the connector saves);
- then the system settles (its saves readable, no background work left);
- local: `a` again after dropping vLLM's prefix cache, so the hit comes from the connector's
  store in the same process (vLLM alone recomputes);
- cross: `b`, another engine process, reads what `a` saved (vLLM alone has no `b`);
- decode (with `decode_tokens`): the cold request generates that many tokens, and its time
  per decode step after the first token is reported: the steps run while the system saves
  and persists what the prefill computed (vLLM alone: nothing runs beside them).

Before each system's turn the host must be quiet (`wait_quiet`: under a quarter of its CPUs
busy for 0.3 s, waiting `quiet_wait_s` at most): a system's background work that outlives
its settle (a server still storing) would otherwise land on whichever system comes next.

TTFT is measured inside the engine process: from reading the request to the end of the step
that produced the first token (`Engine.submit`); `max_tokens` tokens are generated, and every
system's tokens for every case must equal vLLM alone's cold output for the same prompt
(`mismatches`; a shorter output, the start of it). `cached` is vLLM's `num_cached_tokens`
(prefix cache plus what the connector loaded; for kvtier less what it promised and the
engine recomputed, which vLLM still counts): a hit shows as all but the prompt's last
block. A peer that cannot run here is skipped with its reason; kvtier and vLLM alone must
run.
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvtier.tools.bench.vllm import BenchSpec, Result
from kvtier.tools.vllm_engine import EngineError, make_tiny_model, random_prompt

PEERS = ("mooncake-store", "mooncake-store+ssd", "lmcache")
CASES = ("cold", "local", "cross")
ROWS = CASES + ("decode",)  # decode: seconds per decode step, not a TTFT


@dataclass
class PeersSpec:
    sizes: tuple[int, ...] = (8192, 16384)
    repeats: int = 3
    peers: tuple[str, ...] = ("mooncake-store",)
    dtype: str = "float32"  # bf16 rounding flips near-ties of a random model's logits
    pool: str = "files"  # kvtier's pool (`bench vllm --pool`)
    kvtier: bool = True  # false: only the peers and vLLM alone (a quicker check of a peer)
    max_tokens: int = 4  # per request: the first is timed, all are checked
    inproc: bool = True
    decode_tokens: int = 0  # > 1: the cold request generates this many, its steps are timed
    quiet_wait_s: float = 10.0  # the longest wait for a quiet host before a turn (0: none)

    def __post_init__(self):
        if self.decode_tokens == 1 or self.decode_tokens < 0:
            raise ValueError(f"--decode {self.decode_tokens}: generate 2 tokens or more (0: off)")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"unknown peer {', '.join(unknown)}: use {', '.join(PEERS)}")

    def bench_spec(self) -> BenchSpec:
        """What kvtier's own engines run with (`tools.bench.vllm`)."""
        return BenchSpec(sizes=self.sizes, repeats=self.repeats, dtype=self.dtype,
                         inproc=self.inproc, pool=self.pool)


@dataclass
class Run:
    """One system's numbers at one size: TTFT per case, and what vLLM found cached."""
    system: str
    result: Result
    cached: dict[str, list[int]] = field(default_factory=lambda: {c: [] for c in CASES})
    tokens: dict[str, list[list[int]]] = field(default_factory=lambda: {c: [] for c in CASES})


def _systems(spec: PeersSpec):
    from kvtier.tools.bench import peer_systems as ps
    from kvtier.tools.bench.lmcache_peer import LMCache
    known = {"kvtier": ps.Kvtier, "mooncake-store": ps.MooncakeStore,
             "mooncake-store+ssd": ps.MooncakeStoreSsd, "lmcache": LMCache,
             "vllm-alone": ps.VllmAlone}
    names = (["kvtier"] if spec.kvtier else []) + list(spec.peers) + ["vllm-alone"]
    return [(name, known[name]) for name in names], ps.PeerUnavailable


def start_systems(spec: PeersSpec, root: Path, say) -> tuple[list, dict[str, str]]:
    """Every system that runs here, started side by side (most of a start is importing
    vLLM: one system's imports overlap another's); a peer that cannot run is skipped with
    its reason, and kvtier or vLLM alone failing to start fails the bench."""
    classes, unavailable = _systems(spec)
    make_tiny_model(root / "model")
    prepared, errors, skipped = [], [], {}

    def skip(system, e: BaseException) -> None:
        """A peer's failure to start is its reason to be skipped; anything else's fails."""
        if system.name not in spec.peers or not isinstance(e, (unavailable, EngineError)):
            raise e
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        skipped[system.name] = first if isinstance(e, unavailable) else \
            f"its engine failed to start: {first} (logs in {root})"
        say(f"skipping {system.name}: {skipped[system.name]}")

    try:
        for _, cls in classes:
            system = cls(root, spec.bench_spec())
            try:
                system.prepare()
                prepared.append(system)
            except Exception as e:
                skip(system, e)
        say("starting " + ", ".join(s.name for s in prepared))
        with ThreadPoolExecutor(len(prepared)) as pool:
            errors = list(pool.map(_start, prepared))
    finally:
        if len(errors) < len(prepared):  # a prepare (or the pool) failed
            for system in prepared:
                system.close()
    started, fatal = [], None
    for system, e in zip(prepared, errors):
        if e is None:
            started.append(system)
            continue
        system.close()
        try:
            skip(system, e)
        except Exception as err:
            fatal = fatal or err
    if fatal is not None:
        for system in started:
            system.close()
        raise fatal
    return started, skipped


def _start(system) -> BaseException | None:
    try:
        system.start()
    except Exception as e:  # reported by the caller, after every start has ended
        return e
    return None


def cpu_times() -> tuple[int, int]:
    """(busy, all) jiffies of the host's CPUs so far, from /proc/stat: busy is user, nice,
    system, irq and softirq; all adds idle, iowait and what the hypervisor stole."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6]
    return busy, busy + v[3] + v[4] + v[7]


def wait_quiet(timeout_s: float = 10.0, busy_below: float = 0.25, window_s: float = 0.3,
               step_s: float = 0.1, sample=cpu_times, clock=time.monotonic,
               sleep=time.sleep) -> float:
    """Wait until the host's CPUs have been under `busy_below` busy for `window_s`, at
    most `timeout_s`; the seconds waited."""
    start = clock()
    prev, quiet_since = sample(), None
    while clock() - start < timeout_s:
        sleep(step_s)
        cur, now = sample(), clock()
        spent = cur[1] - prev[1]
        if spent > 0 and (cur[0] - prev[0]) / spent < busy_below:
            quiet_since = now if quiet_since is None else quiet_since
            if now - quiet_since >= window_s - 1e-9:
                break
        else:
            quiet_since = None
        prev = cur
    return clock() - start


def measure(system, prompt: list[int], run: Run, max_tokens: int,
            decode_tokens: int = 0) -> None:
    """cold on `a` (with `decode_tokens`, its decode steps timed), settle, local on `a` (its
    prefix cache dropped), cross on `b`."""
    def one(node: str, case: str, tokens: int = max_tokens):
        done = system.engines[node].submit(prompt, tokens).result(timeout=900)
        run.result.ttft_s[case].append(done.ttft_s)
        run.cached[case].append(done.served_tokens)
        run.tokens[case].append(done.token_ids)
        return done

    cold = one("a", "cold", decode_tokens or max_tokens)
    if decode_tokens and cold.done_step > cold.first_step:
        run.result.ttft_s["decode"].append(
            (cold.e2e_s - cold.ttft_s) / (cold.done_step - cold.first_step))
    system.settle(prompt)
    system.engines["a"].reset_prefix_cache()
    one("a", "local")
    if "b" in system.engines:
        one("b", "cross")


def mismatches(runs: list[Run]) -> list[str]:
    """Every (system, case, round) whose tokens differ from vLLM alone's cold ones."""
    ref = {r.result.size: r.tokens["cold"] for r in runs if r.system == "vllm-alone"}
    out = []
    for r in runs:
        for case in CASES:
            for i, toks in enumerate(r.tokens[case]):
                want = ref[r.result.size][i]
                if toks != want[:len(toks)] or not toks:
                    out.append(f"{r.system} {case}@{r.result.size} round {i + 1}: {toks} "
                               f"!= vLLM alone's {want}")
    return out


def run_peers(spec: PeersSpec, root: Path | None = None, progress=print) -> dict:
    """Run the comparison; the document `--json` writes (rows per system, size and case)."""
    load_start = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-peers-") as tmp:
        root = Path(root or tmp)
        root.mkdir(parents=True, exist_ok=True)
        systems, skipped = [], {}
        try:
            systems, skipped = start_systems(spec, root, progress)
            runs = {(s.name, n): Run(s.name, Result(n, {c: [] for c in ROWS}))
                    for s in systems for n in spec.sizes}
            seed, waited = 20_000, 0.0
            for n in spec.sizes:
                for r in range(spec.repeats):
                    seed += 1
                    prompt = random_prompt(seed, n)
                    k = r % len(systems)
                    for system in systems[k:] + systems[:k]:
                        progress(f"{n} tokens, round {r + 1}: {system.name}")
                        waited += wait_quiet(spec.quiet_wait_s)
                        measure(system, prompt, runs[system.name, n], spec.max_tokens,
                                spec.decode_tokens)
        finally:
            for system in systems:
                system.close()
    runs_list = list(runs.values())
    return {"spec": asdict(spec), "systems": [s.name for s in systems], "skipped": skipped,
            "loadavg": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
            "quiet_wait_s": round(waited, 1),
            "rows": [row(r, case) for r in runs_list for case in ROWS
                     if r.result.ttft_s[case]],
            "mismatches": mismatches(runs_list), "missed_hits": missed_hits(runs_list)}


def missed_hits(runs: list[Run], block: int = 32) -> list[str]:
    """Connector cases that did not find what they should: a cold prompt with anything
    cached, or a local/cross read missing more than the prompt's last block."""
    out = []
    for r in runs:
        if r.system == "vllm-alone":
            continue
        n = r.result.size
        for case in CASES:
            for i, got in enumerate(r.cached[case]):
                if (case == "cold" and got) or (case != "cold" and got < n - block):
                    out.append(f"{r.system} {case}@{n} round {i + 1}: {got} of {n} tokens "
                               "cached")
    return out


def row(run: Run, case: str) -> dict:
    """One system, size and case: ms (per decode step for `decode`, else TTFT)."""
    res = run.result
    out = {"system": run.system, "size": res.size, "case": case,
           "median_ms": res.median_ms(case), "min_ms": res.min_ms(case),
           "p99_ms": res.p99_ms(case)}
    if case == "decode":
        return out | {"step_s": res.ttft_s[case]}
    return out | {"ttft_s": res.ttft_s[case], "cached_tokens": run.cached[case]}
