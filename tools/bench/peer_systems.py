"""The systems `kvtier bench vllm --peers` puts side by side, each as its users would run it.

A system is up to two engine processes of the tiny random model (`a` saves, `b` reads what
`a` saved: the cross-process hit) and what they share, with `settle(prompt)` returning once
what `a` saved of a prompt can be read (so no background work runs beside the next
measurement):

- `kvtier`: the two kvtier engines of `bench vllm` (`tools.bench.vllm.Bench`: nodes `a` and
  `b`, pool, nvme, sharedfs); settled when sharedfs holds every chunk (the mover is done).
- `mooncake-store`: vLLM's own `MooncakeStoreConnector` in its `standalone-store` mode: one
  `mooncake_master` and one `mooncake_client` lending the pool, so blocks outlive the engine
  that saved them (in its embedded mode they go with the saving process); each engine its
  own `lookup_rpc_port` (the default IPC path is one per host: a second engine's lookup
  server would unlink the first's); settled when the master's key count stops growing.
- `mooncake-store+ssd`: the same with Mooncake's own SSD offload under the pool
  (`start_standalone_store`); its files are removed at close.
- `lmcache`: `tools.bench.lmcache_peer`.
- `vllm-alone`: one engine without a connector, the reference every output is checked
  against; its "local" after a prefix-cache reset is a recompute, and it has no `b`.

A peer that cannot run here raises `PeerUnavailable` (one line: why), and the bench skips it.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvtier.store.base.config import MasterConfig, MooncakeTierConfig
from kvtier.store.base.units import parse_size
from kvtier.tiers.mooncake.master import EmbeddedMaster, free_port
from kvtier.tiers.mooncake.service import PoolService
from kvtier.tools.bench.vllm import Bench, BenchSpec
from kvtier.tools.vllm_engine import Engine, random_prompt

BLOCK_SIZE = 32  # vLLM's block size, kvtier's chunk: every system hits at the same grain
LOOPBACK_ENV = {"VLLM_HOST_IP": "127.0.0.1", "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}


class PeerUnavailable(RuntimeError):
    """The peer cannot run on this machine; the message says why, in one line."""


class System:
    """Engines `a` (and `b`) of one system; subclasses start them and know when saves land."""

    name = ""
    inproc = True  # false: vLLM's multi-process engine whatever the bench's spec says

    def __init__(self, root: Path, spec: BenchSpec):
        self.root, self.spec = root, spec
        self.engines: dict[str, Engine] = {}
        self.settled = 0  # objects stored at the last settle

    def prepare(self) -> None:
        """Start what the engines share, on the calling thread: the Mooncake children die
        with the thread that started them (PR_SET_PDEATHSIG follows the thread), and
        `start` may run on a short-lived one."""

    def start(self) -> None:
        """Start the engines (safe on any thread, beside other systems' starts)."""
        raise NotImplementedError

    def stored(self) -> int | None:
        """How many objects the system's store holds, or None when it has no store."""
        return None

    def settle(self, prompt: list[int], timeout_s: float = 60, quiet_s: float = 0.3) -> None:
        """Return once what `a` saved of `prompt` can be read: the store holds more objects
        than at the last settle and the count has not grown for `quiet_s`. The peers save
        from threads (or a server) of their own after the step, and the bench's prompts
        are all new, so every save adds objects."""
        last = self.stored()
        if last is None:
            return
        deadline, since = time.monotonic() + timeout_s, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = self.stored()
            if now != last:
                last, since = now, time.monotonic()
            elif now > self.settled and time.monotonic() - since >= quiet_s:
                break
        self.settled = last

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()

    def engine(self, node: str, kv_transfer_config: dict | None, env: dict | None = None,
               python: str | None = None) -> Engine:
        return Engine(self.root / "model", self.root / f"{self.name}-{node}.log",
                      kv_transfer_config=kv_transfer_config, block_size=BLOCK_SIZE,
                      dtype=self.spec.dtype, max_model_len=max(self.spec.sizes) + 256,
                      inproc=self.spec.inproc and self.inproc, env=env, python=python)

    def start_engines(self, configs: dict[str, tuple[dict | None, dict | None]],
                      python: str | None = None) -> None:
        """Start the engines side by side (most of a start is importing vLLM), then pay
        the one-time costs of a first request and of `b`'s first read from the store, as
        `bench vllm` does for kvtier."""
        with ThreadPoolExecutor(len(configs)) as pool:
            futures = {node: pool.submit(self.engine, node, kvc, env, python)
                       for node, (kvc, env) in configs.items()}
            for node, fut in futures.items():
                self.engines[node] = fut.result()
        for engine in self.engines.values():
            for i, n in enumerate((512, min(self.spec.sizes))):
                engine.generate([random_prompt(90_000 + i, n)], 1)
        if "b" in self.engines:
            warm = random_prompt(90_002, min(self.spec.sizes))
            self.engines["a"].generate([warm], 1)
            self.settle(warm)
            self.engines["b"].generate([warm], 1)


class Kvtier(System):
    """kvtier's two engines, as `bench vllm` runs them (the pool as `spec.pool` says)."""

    name = "kvtier"

    def prepare(self) -> None:
        self.bench = Bench(self.root / "kvtier", self.spec, progress=lambda _msg: None)

    def start(self) -> None:
        self.bench.start()
        self.engines = self.bench.engines

    def settle(self, prompt: list[int]) -> None:
        self.bench.wait_persisted([prompt])

    def close(self) -> None:
        self.bench.close()


class MooncakeStore(System):
    """vLLM's `MooncakeStoreConnector`, standalone-store mode, over TCP on loopback."""

    name = "mooncake-store"
    POOL = "2GiB"  # the `mooncake_client`'s segment: kvtier's pool service lends as much
    ssd = False  # Mooncake's SSD tier under the pool (`mooncake-store+ssd`)

    def prepare(self) -> None:
        home = self.root / self.name  # its config file and logs, apart from another's
        home.mkdir(parents=True, exist_ok=True)
        self.store = start_standalone_store(
            home, self.POOL, ssd_bytes=2 * parse_size(self.POOL) if self.ssd else None)

    def start(self) -> None:
        self.start_engines({node: (mooncake_store_transfer_config(), self.store.env)
                            for node in ("a", "b")})

    def stored(self) -> int:
        """The keys the master holds."""
        with urllib.request.urlopen(self.store.master.metrics_url, timeout=2) as resp:
            m = re.search(r"^master_key_count (\S+)", resp.read().decode(), re.M)
        return int(float(m.group(1))) if m else 0

    def close(self) -> None:
        super().close()
        self.store.stop()


class MooncakeStoreSsd(MooncakeStore):
    """The same with Mooncake's SSD offload (every object also written to disk as it is
    put); the bench's prompts fit the pool, so what it measures is the writes' cost."""

    name = "mooncake-store+ssd"
    ssd = True


@dataclass
class StandaloneStore:
    """A running standalone store: its master, its `mooncake_client`, the environment its
    engines need, and the directory of its SSD tier (None without one)."""

    master: EmbeddedMaster
    client: PoolService
    env: dict[str, str]
    disk: Path | None = None

    def stop(self) -> None:
        """Stop the client, then the master it reports to; the SSD tier's files go with
        them (blocks, not a result: the logs stay)."""
        self.client.stop()
        self.master.stop()
        if self.disk is not None:
            shutil.rmtree(self.disk, ignore_errors=True)


def start_standalone_store(root: Path, capacity: str | int, ssd_bytes: int | None = None,
                           ) -> StandaloneStore:
    """What `MooncakeStoreConnector` engines in `standalone-store` mode join: a master and
    a `mooncake_client` lending `capacity` (a kvtier pool service is one), started on the
    calling thread, and the environment the engines need (their Mooncake config file, on
    loopback). Stop it when done.

    `ssd_bytes`: Mooncake's own SSD tier under the pool, in `root / "mooncake-ssd"`, set up
    as its documentation says (`--enable_offload` on the master and the client, the
    client's bucket storage backend there, at most `ssd_bytes`, `enable_offload` in the
    engines' config): objects are written to disk as they are put and read from there once
    the pool has dropped them. Two of its defaults are scaled to a pool this small: a bucket
    is written when it holds 256 MiB (1/16 of a 4 GiB pool; here 1/16 of the pool), and the
    writer wakes every second instead of every 10 (an object waiting for its write is
    pinned in the pool, and a pool of a few hundred MiB fills with them in 10 s: every
    put is then refused)."""
    flags, env, disk = {}, {}, None
    if ssd_bytes is not None:
        disk = root / "mooncake-ssd"
        disk.mkdir(parents=True, exist_ok=True)
        flags = {"enable_offload": "true"}
        env = {"MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": str(disk.resolve()),
               "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
               "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(
                   max(1 << 20, parse_size(capacity) // 16)),
               "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
               "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(ssd_bytes)}
    master = EmbeddedMaster(MasterConfig(address=f"127.0.0.1:{free_port()}", run_dir=root,
                                         extra_flags=flags),
                            log_path=root / "mooncake-store-master.log").start()
    try:
        tier = MooncakeTierConfig(kind="mooncake", name="pool", capacity=capacity,
                                  buffer="128MiB", service=f"127.0.0.1:{free_port()}")
        client = PoolService(tier, master.cfg, log_path=root / "mooncake-store-client.log",
                             extra_flags=flags, env=env).start()
    except BaseException:
        master.stop()
        raise
    config = root / "mooncake-store.json"
    config.write_text(json.dumps({
        "metadata_server": master.cfg.metadata_server,
        "master_server_address": master.address, "protocol": "tcp", "device_name": "",
        "mode": "standalone-store", "global_segment_size": 0,
        "local_buffer_size": 512 << 20, "enable_offload": disk is not None}))
    return StandaloneStore(master, client, {"MOONCAKE_CONFIG_PATH": str(config),
                                            **LOOPBACK_ENV}, disk)


def mooncake_store_transfer_config() -> dict:
    """One engine's `MooncakeStoreConnector` config: a lookup port of its own."""
    return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lookup_rpc_port": free_port()}}


class VllmAlone(System):
    """One engine, no connector: the reference outputs and vLLM's own cold prefill."""

    name = "vllm-alone"

    def start(self) -> None:
        self.start_engines({"a": (None, None)})
