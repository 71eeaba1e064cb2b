"""Real engines for `kvtier replay --engine vllm`: N vLLM processes on one kvtier cluster.

`VllmCluster(root, cfg, ...)` starts, for one configuration (`tools.replay.cluster`), a
fresh `mooncake_master` and the pool its engines share (unless the configuration has no
store): with `pool="files"` each engine lends its share from a file in a /dev/shm directory
of the run's own, which the others copy straight out of (`segment_dir`, the README's setup
for engines on one node), with `pool="service"` the node's pool service holds the whole
pool and the engines join it through shared memory, and with `pool="embedded"` each lends
its share over TCP; `pool="auto"` (the default) is files on one host when /dev/shm has
room for the shares, else the service, and embedded across hosts (`choose_pool`);
`start()` N engine processes
(`tools.vllm_engine.Engine`: the tiny random model, one process each, started in parallel),
each with the same KV cache size (`num_blocks`) and, for store configurations, the kvtier
connector with its node's policy (own index and nvme dir, one shared dir). It warms each
engine up with one short prompt nobody else sends, and gives one backend per instance for
`tools.replay.live`, which submits each request on its own (the engines batch continuously;
baseline and kvtier configurations take the same path). A peer's configuration
(`mooncake-store`, `lmcache`) starts the pool its connector joins instead
(`tools.bench.peer_pool`), and the engines with that connector. `close()` stops the engines
(the connector finishes queued saves) and then the master; `held()` reads, afterwards, what
each node's index holds per tier.

Requests carry their session as a kvtier hint (`kv_transfer_params`), as an agent framework
that knows its session ids would send it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from kvtier.store.base.config import MasterConfig
from kvtier.tiers.mooncake.master import EmbeddedMaster, free_port
from kvtier.tools.bench.peer_pool import start_peer_pool
from kvtier.tools.bench.peer_systems import PeerUnavailable
from kvtier.tools.replay.cluster import (PEERS, POOLS, Config, ReplayError, Sizing,
                                         node_policy, pool_split)
from kvtier.tools.replay.plan import VOCAB, Plan
from kvtier.tools.threads import in_threads
from kvtier.tools.vllm_engine import Completion, Engine, EngineError, kvtier_transfer_config

WARMUP_SEED = 987_654_321
SEGMENT_TMPFS = "/dev/shm"  # `pool="files"`: where the lenders' files go


def tmpfs_free(directory: str = SEGMENT_TMPFS) -> int:
    """Bytes a new file in `directory` may still take (0 when it is not there)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def choose_pool(pool: str, hosts: int, need: int, free: int) -> tuple[str, str | None]:
    """The pool the engines share, and a line saying why when `auto` did not pick files.
    `need`: the bytes the lenders' files take (every engine's share), `free`: what the
    tmpfs holds (`tmpfs_free`). Files are the README's setup for engines on one node (a
    load copies out of the lender's file, no other process in its path); across hosts
    the engines lend over TCP; a tmpfs too small for the files (Docker's /dev/shm is 64 MiB
    unless `--shm-size` says more) takes the pool service, whose memory is not on it. An
    explicit `files` that does not fit is an error, raised here rather than at the
    engines' start."""
    if pool not in POOLS:
        raise ReplayError(f"--pool must be one of {', '.join(POOLS)}, not {pool!r}")
    if pool == "auto" and hosts > 1:
        return "embedded", None
    if pool not in ("auto", "files") or need <= free:
        return ("files" if pool == "auto" else pool), None
    short = (f"{SEGMENT_TMPFS} has {free >> 20} MiB free, the engines' segment files need "
             f"{need >> 20} MiB")
    if pool == "files":
        raise ReplayError(f"--pool files: {short}; grow the tmpfs (docker run --shm-size) or "
                          "use --pool service")
    return "service", (f"{short}: the engines join a pool service instead (grow the tmpfs, "
                       "docker run --shm-size, for the README's setup)")


class VllmBackend:
    """One engine as a replay backend (see `tools.replay.live`): each request submitted on
    its own, with its own output length, as a client of `vllm serve` would send it."""

    def __init__(self, engine: Engine, plan: Plan, hints: bool):
        self.engine, self.plan, self.hints = engine, plan, hints

    def submit(self, i: int, done) -> None:
        params = ({"kvtier": {"session_id": f"s{int(self.plan.session[i])}"}}
                  if self.hints and self.plan.session[i] >= 0 else None)
        fut = self.engine.submit(self.plan.prompt(i), int(self.plan.output_tokens[i]), params)
        fut.add_done_callback(lambda f: done(f.exception() or _result(f.result())))


def _result(c: Completion) -> dict:
    kv = (c.kv_transfer_params or {}).get("kvtier", {})
    return {"cached": c.served_tokens, "tiers": kv.get("hit_tokens", {}),
            "recomputed": kv.get("recomputed_tokens", 0),
            "declined": kv.get("declined_tokens", 0),
            "saved_chunks": kv.get("saved_chunks", 0), "ttft_s": c.ttft_s, "e2e_s": c.e2e_s,
            "output_tokens": len(c.token_ids), "added_s": c.added_s, "queued_s": c.queued_s,
            "prefill_s": c.prefill_s, "preemptions": c.preemptions}


class VllmCluster:
    def __init__(self, root: Path, cfg: Config, n: int, model: Path, sizing: Sizing, *,
                 chunk_tokens: int, block_size: int, num_blocks: int, max_model_len: int,
                 dtype: str, eviction: str, admission: str, engines_alongside: int = 1,
                 pool: str = "auto", inproc: bool = True, hosts: int = 1,
                 shared_fs: str = "dir", say=print):
        self.root, self.cfg, self.n = root, cfg, n
        self.master: EmbeddedMaster | None = None
        self.service = None
        self.segment_dir: Path | None = None  # `pool="files"`: the lenders' files, a tmpfs
        self.peer = None  # the pool a peer's engines join (`tools.bench.peer_pool`)
        self.hosts = None  # a HostCluster: engine k on host k % hosts, the master on one more
        self.engines: list[Engine | None] = [None] * n
        self.policies: list[dict | None] = [None] * n
        self.prefixes: list[list[str] | None] = [None] * n
        root.mkdir(parents=True, exist_ok=True)
        need = (sizing.segment_bytes(cfg.dram_frac) * n * engines_alongside
                if cfg.uses_store else 0)
        pool, why = choose_pool(pool, hosts, need, tmpfs_free())
        if why:  # only ever said when there are segment files to place (need > 0)
            say(f"[{cfg.label}] {why}")
        self.pool = pool
        if cfg.uses_store and hosts > 1:
            if pool == "service":
                raise ReplayError("--hosts with --pool service: a pool service serves the "
                                  "engines of its own host only; use --pool embedded")
            from kvtier.tools.hosts.cluster import HostCluster
            self.hosts = HostCluster.for_engines(hosts, root / "hosts", shared_fs)
            address = self.hosts.master_address
            self.policies = [node_policy(root, f"n{k}", address, cfg, sizing, chunk_tokens,
                                         eviction, admission, count_hosts=True,
                                         shared=self.hosts.shared_of(k % hosts))
                             for k in range(n)]
            self.prefixes = [self.hosts.hosts.command(k % hosts, []) for k in range(n)]
        elif cfg.kind in PEERS:
            try:
                self.peer = start_peer_pool(cfg.kind, root,
                                            sizing.segment_bytes(cfg.dram_frac) * n,
                                            sizing.disk_bytes())
            except PeerUnavailable as e:
                raise ReplayError(f"--baselines {cfg.kind}: {e}") from e
        elif cfg.uses_store:
            mcfg = MasterConfig(address=f"127.0.0.1:{free_port()}", run_dir=root / "run")
            self.master = EmbeddedMaster(mcfg, log_path=root / "master.log").start()
            service = self._start_service(pool, root, mcfg, cfg, sizing, chunk_tokens,
                                          eviction, admission)
            if pool == "files":
                self.segment_dir = Path(tempfile.mkdtemp(prefix="kvtier-replay-",
                                                         dir=SEGMENT_TMPFS))
            self.policies = [node_policy(root, f"n{k}", mcfg.address, cfg, sizing,
                                         chunk_tokens, eviction, admission, service=service,
                                         run_dir=mcfg.run_dir if service else None,
                                         metrics_port=self.master.metrics_port,
                                         segment_dir=self.segment_dir)
                             for k in range(n)]
        # One OpenMP team per engine sized to its share of the cores: the in-process engine
        # does not bind threads, so N engines of (cores) spinning threads each oversubscribe
        # the machine (4 engines on 2 cores spent ~200 ms a decode step), where production
        # gives each instance cores of its own.
        threads = max(1, (os.cpu_count() or 1) // (n * engines_alongside))
        self._kw = dict(block_size=block_size, num_blocks=num_blocks,
                        max_model_len=max_model_len, dtype=dtype, inproc=inproc,
                        env={"OMP_NUM_THREADS": str(threads)},
                        engine_args={"disable_log_stats": False})
        self.model, self.say = model, say

    def _start_service(self, pool: str, root: Path, mcfg: MasterConfig, cfg: Config,
                       sizing: Sizing, *policy_args) -> str | None:
        """With `pool="service"`, start the node's pool service, holding the whole pool (the
        N engines' shares), on this thread; return its address."""
        if pool in ("embedded", "files"):
            return None
        from kvtier.store.base.config import policy_from_dict
        from kvtier.tiers.mooncake.service import PoolService
        address = f"127.0.0.1:{free_port()}"
        probe = node_policy(root, "service", mcfg.address, cfg, sizing, *policy_args,
                            service=address)
        dram = policy_from_dict(probe).tiers[0]
        self.service = PoolService(dram, mcfg, log_path=root / "pool-service.log").start()
        return address

    def start(self) -> "VllmCluster":
        """Start the engines (in parallel); any thread may call it, the master already runs
        (it was started on the constructing thread: it dies with the thread that started
        it)."""
        self.say(f"[{self.cfg.label}] starting {self.n} engines")
        try:
            self._start_all(self.model)
        except BaseException:
            self.close()
            raise
        return self

    def _start_all(self, model: Path) -> None:
        def start(k: int) -> None:
            kw = dict(self._kw)
            if self.policies[k]:
                ktc = kvtier_transfer_config(self.policies[k], node_id=f"n{k}",
                                             staging_buffer="16MiB")
            elif self.peer is not None:
                ktc = self.peer.engine(kw)
            else:
                ktc = None
            e = Engine(model, self.root / f"engine-n{k}.log", kv_transfer_config=ktc,
                       prefix=self.prefixes[k], **kw)
            self.engines[k] = e
            e.submit(_warmup_prompt(k), 1).result(600)  # the path the replay takes

        try:
            in_threads([lambda k=k: start(k) for k in range(self.n)])
        except Exception as e:
            raise ReplayError(f"{self.cfg.label}: an engine failed to start ({e}); "
                              f"see the engine logs under {self.root}") from e

    def backends(self, plan: Plan) -> list[VllmBackend]:
        return [VllmBackend(e, plan, hints=self.cfg.uses_store) for e in self.engines]

    def held(self) -> dict[str, dict[str, int]]:
        """Blocks and bytes each tier holds at the end, summed over the nodes' indexes."""
        from kvtier.store.base.index import Index
        from kvtier.store.check.summary import summarize
        out: dict[str, dict[str, int]] = {}
        for p in self.policies:
            if p is None:
                continue
            ix = Index(Path(p["index"]["path"]), readonly=True, recover=False)
            try:
                for name, t in summarize(ix)["tiers"].items():
                    agg = out.setdefault(name, {"blocks": 0, "bytes": 0})
                    agg["blocks"] += t["blocks"]
                    agg["bytes"] += t["bytes"]
            finally:
                ix.close()
        return out

    def close(self) -> None:
        for e in self.engines:
            if e is not None:
                try:
                    e.close()
                except (EngineError, OSError):
                    pass  # the engine log has the story; keep closing the others
        self.engines = [None] * self.n
        if self.service is not None:
            self.service.stop()
            self.service = None
        if self.peer is not None:
            self.peer.stop()
            self.peer = None
        if self.master is not None:
            self.master.stop()
            self.master = None
        if self.segment_dir is not None:  # lenders remove their files; a crashed one's stay
            shutil.rmtree(self.segment_dir, ignore_errors=True)
            self.segment_dir = None
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None

    def pool_split(self) -> dict[str, int] | None:
        """On several hosts: pool blocks loaded from same-host and cross-host lenders, from
        the counters the engines left in their indexes (read after they exited)."""
        if not any(self.prefixes):
            return None
        from kvtier.store.base.index import Index
        from kvtier.store.counters import read_counters
        dram = []
        for p in self.policies:
            ix = Index(Path(p["index"]["path"]), readonly=True, recover=False)
            try:
                dram.append(read_counters(ix).get("dram", {}))
            finally:
                ix.close()
        return pool_split(dram)


def _warmup_prompt(k: int) -> list[int]:
    import random
    rng = random.Random(WARMUP_SEED + k)
    return [rng.randrange(1, VOCAB) for _ in range(96)]
