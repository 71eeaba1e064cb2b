"""What a peer's engines join in `kvtier replay --baselines mooncake-store,lmcache`.

`start_peer_pool(kind, root, pool_bytes, disk_bytes)` starts, on the calling thread, the
shared pool a peer connector's engines use, sized like kvtier's: for `mooncake-store` a
master and a `mooncake_client` lending the pool (`tools.bench.peer_systems`), for
`mooncake-store+ssd` the same with Mooncake's own SSD tier under it (`disk_bytes` in a
directory under `root`), for `lmcache` an `lmcache server` with an L1 of that size
(`tools.bench.lmcache_peer`). The returned object says how to start one engine on it
(`engine(kw)`) and stops what it started (`stop()`).
"""

from __future__ import annotations

from pathlib import Path


class MooncakeStorePool:
    """A master and a `mooncake_client` lending the pool; engines in `standalone-store`
    mode, each with a lookup port of its own."""

    ssd = False  # Mooncake's SSD tier under the pool

    def __init__(self, root: Path, pool_bytes: int, disk_bytes: int):
        from kvtier.tools.bench.peer_systems import start_standalone_store
        self.store = start_standalone_store(root, pool_bytes,
                                            ssd_bytes=disk_bytes if self.ssd else None)

    def engine(self, kw: dict) -> dict:
        """Update one engine's keyword arguments in place; return its transfer config."""
        from kvtier.tools.bench.peer_systems import mooncake_store_transfer_config
        kw["env"] = {**kw["env"], **self.store.env}
        return mooncake_store_transfer_config()

    def stop(self) -> None:
        self.store.stop()


class MooncakeStoreSsdPool(MooncakeStorePool):
    """The same, with Mooncake's SSD offload: every object put is also written to disk by
    the `mooncake_client`, and read from there once the pool has dropped it."""

    ssd = True


class LMCachePool:
    """An `lmcache server` with an L1 of the pool's size; its engines are vLLM
    multi-process engines running the peers' venv python (they cannot run in one
    process)."""

    def __init__(self, root: Path, pool_bytes: int, disk_bytes: int):
        from kvtier.tools.bench.lmcache_peer import QUIET_ENV, LMCacheServer
        self.server = LMCacheServer(root, pool_bytes)  # PeerUnavailable: why not
        self.env = dict(QUIET_ENV)

    def engine(self, kw: dict) -> dict:
        """Update one engine's keyword arguments in place; return its transfer config."""
        kw.update(env={**kw["env"], **self.env}, inproc=False, python=self.server.python)
        return self.server.transfer_config()

    def stop(self) -> None:
        self.server.stop()


POOLS = {"mooncake-store": MooncakeStorePool, "mooncake-store+ssd": MooncakeStoreSsdPool,
         "lmcache": LMCachePool}


def start_peer_pool(kind: str, root: Path, pool_bytes: int, disk_bytes: int):
    """Start the pool `kind`'s engines join, holding `pool_bytes` in DRAM (and `disk_bytes`
    on disk where the peer has a disk tier); `PeerUnavailable` (one line) where that peer
    cannot run here."""
    return POOLS[kind](root, pool_bytes, disk_bytes)
