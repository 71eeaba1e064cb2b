"""Tier factories for the contract suite, and the deterministic blocks the tests write.

`FACTORIES` maps a test id to a `TierFactory`; `test_contract.py` runs every test once per
entry. A new tier joins the suite with one entry here: a factory that builds its config under
a test directory, and says how to reach its stored bytes (so tests can corrupt them) and what
it does when full. Everything here is plain data and importable from a child process
(`tier_worker.py` opens the same tiers by factory name), so specs travel as JSON.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kvtier.store.base import block
from kvtier.store.base.config import (MasterConfig, MooncakeTierConfig, NvmeTierConfig,
                                 SharedFSTierConfig)
from kvtier.store.base.index import Index
from kvtier.store.base.keys import Namespace, id_chain_hashes, make_keys
from kvtier.store.base.units import parse_size
from kvtier.tiers import Tier, TierContext, open_tier
from kvtier.tiers.mooncake.master import free_port, master_answers
from kvtier.tiers.mooncake.service import PoolService
from kvtier.tiers.nvme.regions import unpack_loc
from kvtier.tiers.sharedfs.files import block_path

NS = Namespace(model="kvtier-test-tiers").fingerprint()
OTHER_NS = Namespace(model="kvtier-test-other-ns").fingerprint()
KiB, MiB = 1024, 1024 * 1024
WORKER = Path(__file__).with_name("tier_worker.py")


# ---- deterministic blocks --------------------------------------------------------------

def keys_for(start: int, n: int, ns: str = NS, salt: bytes = b"") -> list[str]:
    """Key i of a test is the same in every process and call (no chaining across a range)."""
    return [make_keys(ns, id_chain_hashes([i], salt=salt))[0] for i in range(start, start + n)]


def payload_for(key: str, size: int) -> bytes:
    return np.random.default_rng(int(key[-15:], 16)).bytes(size)


def frame_for(key: str, size: int, aligned: bool = True) -> memoryview:
    """A sealed frame of `size` payload bytes, page-aligned (zero copy) or not (bounced)."""
    buf = block.alloc_aligned(block.HEADER_SIZE + size) if aligned else \
        memoryview(bytearray(block.HEADER_SIZE + size + 1))[1:]
    buf[block.HEADER_SIZE:block.HEADER_SIZE + size] = payload_for(key, size)
    block.seal(buf, key, size)
    return buf


def out_for(size: int, aligned: bool = True) -> memoryview:
    n = block.HEADER_SIZE + size
    return block.alloc_aligned(n) if aligned else memoryview(bytearray(n + 3))[3:]


def check_hit(key: str, out: memoryview, n: int, size: int) -> bool:
    """True if a get of `key` returned exactly the bytes that were put."""
    return n == size and bytes(out[block.HEADER_SIZE:block.HEADER_SIZE + n]) == \
        payload_for(key, size)


# ---- factories -------------------------------------------------------------------------

@dataclass
class Spec:
    """Everything a process needs to open one tier (JSON-serializable)."""

    factory: str
    root: str
    node_id: str = "node-a"
    capacity: str = "128MiB"
    extra: dict | None = None

    @property
    def index_path(self) -> Path:
        return Path(self.root) / f"index-{self.node_id}"


@dataclass
class TierFactory:
    make_config: Callable[[Spec], object]
    raw_read: Callable[[Tier, str], bytes]          # the stored frame, as stored
    raw_write: Callable[[Tier, str, bytes], None]   # replace it (shorter = truncated)
    reclaims_when_full: bool = True                 # False: put raises TierFullError
    max_payload: int = 16 * MiB
    # Called with the test's pytest request; returns Spec.extra (e.g. a master fixture's
    # address). None: nothing to set up.
    extra_for: Callable[[object], dict] | None = None
    # False where a block lives in the memory of the process that wrote it (the pool: a
    # closed or exited client takes its segment, and the blocks in it, along).
    outlives_writer: bool = True
    # True: the processes of a node share one pool of `capacity` (a pool service), where
    # each process of the other factories brings its own.
    shared_by_processes: bool = False
    # Called in the test process before a tier or worker opens `spec` (starts what the
    # tier joins, e.g. a pool service). None: nothing to start.
    prepare: Callable[[Spec], None] | None = None

    def open(self, spec: Spec) -> Tier:
        if self.prepare is not None:
            self.prepare(spec)
        index = Index(spec.index_path, map_size_bytes=64 * MiB)
        address = (spec.extra or {}).get("master_address")
        metrics = (spec.extra or {}).get("metrics_port")  # where the master counts usage
        flags = {"metrics_port": str(metrics)} if metrics else {}
        master = (MasterConfig(address=address, embedded=False, extra_flags=flags) if address
                  else MasterConfig())
        tier = open_tier(self.make_config(spec), TierContext(index, spec.node_id, master))
        tier.test_index = index  # type: ignore[attr-defined]
        return tier


def close(tier: Tier) -> None:
    tier.close()
    tier.test_index.close()  # type: ignore[attr-defined]


def _nvme_config(engine: str):
    def make(spec: Spec) -> NvmeTierConfig:
        # 32 MiB regions hold a 16 MiB frame; small test capacities get 4 regions.
        region = min(32 * MiB, parse_size(spec.capacity) // 4 // 4096 * 4096)
        extra = {"region_size": region, **(spec.extra or {})}
        io = {"engine": engine, "queue_depth": 16, **extra.pop("io", {})}
        return NvmeTierConfig(kind="nvme", name="nvme", path=Path(spec.root) / "nvme",
                              capacity=spec.capacity, io=io, **extra)
    return make


def _nvme_extent(tier: Tier, key: str) -> tuple[int, int]:
    e = tier.test_index.get(tier.name, [key])[0]  # type: ignore[attr-defined]
    assert e is not None, f"{key} is not stored"
    return unpack_loc(e.loc_a)[0] * tier.region_bytes + e.loc_b, e.size  # type: ignore


def _nvme_raw_read(tier: Tier, key: str) -> bytes:
    off, size = _nvme_extent(tier, key)
    with open(tier.path / "regions.kvr", "rb") as f:  # type: ignore[attr-defined]
        f.seek(off)
        return f.read(size)


def _nvme_raw_write(tier: Tier, key: str, data: bytes) -> None:
    off, size = _nvme_extent(tier, key)
    data = data[:size] + bytes(max(0, size - len(data)))  # a torn write leaves zeros behind
    fd = os.open(tier.path / "regions.kvr", os.O_WRONLY)  # type: ignore[attr-defined]
    try:
        os.pwrite(fd, data, off)
        os.fsync(fd)  # the tier reads with O_DIRECT: the bytes must be on disk
    finally:
        os.close(fd)


def _sharedfs_config(spec: Spec) -> SharedFSTierConfig:
    return SharedFSTierConfig(kind="sharedfs", name="shared", path=Path(spec.root) / "shared",
                              capacity=spec.capacity, **(spec.extra or {}))


def _sharedfs_raw_read(tier: Tier, key: str) -> bytes:
    return block_path(tier.root, key).read_bytes()  # type: ignore[attr-defined]


def _sharedfs_raw_write(tier: Tier, key: str, data: bytes) -> None:
    block_path(tier.root, key).write_bytes(data)  # type: ignore[attr-defined]


def _mooncake_config(spec: Spec) -> MooncakeTierConfig:
    extra = {k: v for k, v in (spec.extra or {}).items()
             if k not in ("master_address", "metrics_port")}
    # Mooncake's smallest segment is 16 MiB: smaller test capacities round up to it.
    capacity = max(parse_size(spec.capacity), 16 * MiB)
    return MooncakeTierConfig(kind="mooncake", name="dram", capacity=capacity,
                              buffer="16MiB", staging="32MiB", retry_backoff_s=0.01, **extra)


def _mooncake_raw_read(tier: Tier, key: str) -> bytes:
    with tier.client.session() as store:  # type: ignore[attr-defined]
        return store.get(key)


def _mooncake_raw_write(tier: Tier, key: str, data: bytes) -> None:
    with tier.client.session() as store:  # type: ignore[attr-defined]
        store.remove(key, True)
        assert store.put(key, data, tier.client.replicate) == 0  # type: ignore[attr-defined]


def _mooncake_extra(request) -> dict:
    return {"master_address": request.getfixturevalue("shared_master").address}


def _files_extra(request) -> dict:
    """Segments lent from files: every process of the test maps the others' (`segment_dir`)."""
    shm = request.getfixturevalue("tmp_path") / "shm"
    return {**_mooncake_extra(request), "segment_dir": str(shm)}


_SERVICES: dict[str, PoolService] = {}  # pool services this test process started


def _service_extra(request) -> dict:
    """A master and a pool service address of the test's own, stopped when the test ends.
    (A service never unmounts its segment: Mooncake's client exits on any signal without
    it, so a shared master would keep the last test's objects until its client TTL.)"""
    master = request.getfixturevalue("mooncake_master")
    address = f"127.0.0.1:{free_port()}"

    def stop() -> None:
        service = _SERVICES.pop(address, None)
        if service is not None:
            service.stop()
    request.addfinalizer(stop)
    return {"master_address": master.address, "metrics_port": master.metrics_port,
            "service": address, "service_embedded": False}


def _start_service(spec: Spec) -> None:
    """Start the spec's service, sized by the first spec that opens it (in this process)."""
    cfg = _mooncake_config(spec)
    if cfg.service in _SERVICES or master_answers(cfg.service):
        return  # started here already, or by the test process (we are a worker)
    master = MasterConfig(address=spec.extra["master_address"], embedded=False)  # no flags
    _SERVICES[cfg.service] = PoolService(cfg, master).start()


FACTORIES: dict[str, TierFactory] = {
    "mooncake": TierFactory(_mooncake_config, _mooncake_raw_read, _mooncake_raw_write,
                            extra_for=_mooncake_extra, outlives_writer=False),
    # Every process on the node joins one service: a block outlives the process that put it.
    "mooncake-service": TierFactory(_mooncake_config, _mooncake_raw_read, _mooncake_raw_write,
                                    extra_for=_service_extra, prepare=_start_service,
                                    shared_by_processes=True),
    # Segments lent from files, read straight from them by the other processes.
    "mooncake-files": TierFactory(_mooncake_config, _mooncake_raw_read, _mooncake_raw_write,
                                  extra_for=_files_extra, outlives_writer=False),
    "nvme-uring": TierFactory(_nvme_config("uring"), _nvme_raw_read, _nvme_raw_write),
    "nvme-psync": TierFactory(_nvme_config("psync"), _nvme_raw_read, _nvme_raw_write),
    "sharedfs": TierFactory(_sharedfs_config, _sharedfs_raw_read, _sharedfs_raw_write),
}


def open_spec(spec: Spec) -> Tier:
    return FACTORIES[spec.factory].open(spec)


# ---- child processes -------------------------------------------------------------------

def start_worker(spec: Spec, action: str, **args) -> subprocess.Popen:
    """Run `tier_worker.py` on `spec` in a new process; it prints JSON lines to stdout."""
    import json
    from dataclasses import asdict
    prepare = FACTORIES[spec.factory].prepare
    if prepare is not None:
        prepare(spec)
    payload = json.dumps({"spec": asdict(spec), "action": action, "args": args})
    return subprocess.Popen([sys.executable, str(WORKER), payload], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_worker(proc: subprocess.Popen, timeout_s: float = 60) -> list[dict]:
    import json
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}): {err[-2000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]
