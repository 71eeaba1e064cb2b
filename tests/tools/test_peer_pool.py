"""The pools the peer baselines join (`tools.bench.peer_pool`), without engines: a real
`mooncake_master` and `mooncake_client`, read and written by a Mooncake client as the peer's
engines are (a requester lending nothing, so every object lands in the pool)."""

from __future__ import annotations

import time

import pytest

from kvtier.tools.bench.peer_pool import start_peer_pool

MiB = 1 << 20
POOL = 16 * MiB  # Mooncake's smallest segment
OBJECT = 1 * MiB


def _requester(pool):
    store_mod = pytest.importorskip("mooncake.store")
    master = pool.store.master
    store = store_mod.MooncakeDistributedStore()
    assert store.setup("127.0.0.1", master.cfg.metadata_server, 0, 64 * MiB, "tcp", "",
                       master.address) == 0
    return store


def _put_all(store, n: int) -> int:
    """Put n objects; a full pool refuses (-200) until it has made room: retry, bounded.
    Returns how many were refused for good."""
    refused = 0
    for i in range(n):
        for _ in range(100):  # at most 10 s per object
            rc = store.put(f"k{i}", bytes([i % 251]) * OBJECT)
            if rc != -200:
                break
            time.sleep(0.1)
        refused += rc != 0
    return refused


def _readable(store, n: int) -> list[int]:
    """The objects read back whole and right."""
    return [i for i in range(n) if store.get(f"k{i}") == bytes([i % 251]) * OBJECT]


@pytest.mark.parametrize("kind", ["mooncake-store", "mooncake-store+ssd"])
def test_what_outlives_the_pool_is_what_the_peer_keeps_on_disk(tmp_path, kind):
    # Three pools' worth of objects: Mooncake's pool alone keeps at most one pool's worth;
    # with its SSD offload the first objects are still read back (from disk), byte for byte.
    n = 3 * POOL // OBJECT
    pool = start_peer_pool(kind, tmp_path, POOL, 4 * n * OBJECT)
    store = None
    try:
        store = _requester(pool)
        refused = _put_all(store, n)
        read = _readable(store, n)
        if kind == "mooncake-store":
            assert len(read) <= POOL // OBJECT
            assert not (tmp_path / "mooncake-ssd").exists()
        else:
            on_disk = sum(p.stat().st_size for p in (tmp_path / "mooncake-ssd").rglob("*")
                          if p.is_file())
            assert on_disk >= POOL            # more than the pool went to disk
            assert len(read) >= n - refused - POOL // OBJECT // 2, (read, refused)
            assert set(range(POOL // OBJECT)) & set(read)  # the first ones, from disk
    finally:
        if store is not None:
            store.close()
        pool.stop()
    assert not (tmp_path / "mooncake-ssd").exists()  # the disk tier's files go with it
