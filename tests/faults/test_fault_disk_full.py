"""Disk full under the store: nvme and sharedfs on small tmpfs mounts (8 MiB each) whose
policy capacities (64 MiB) the disks cannot hold, so the filesystems say ENOSPC long before
the tiers think they are full.

Promised, and checked: no store call raises; no torn block (every hit has its exact bytes,
no temp file or PENDING entry is left, `check_node` stays clean); the tiers make room by
evicting their own oldest blocks, so saving goes on after the disks fill up and the newest
requests keep hitting; reads of what is stored never stop.
"""

from __future__ import annotations

import pytest

from fault_util import KiB, frame_for, load_checked, make, policy_dict, request_keys, tmpfs  # noqa: F401
from kvtier.store.base.index_record import READY
from kvtier.store.check.node import check_node
from kvtier.store.tiered import TieredStore

SIZE = 64 * KiB
BLOCKS = 4
REQUESTS = 100  # 26 MiB of frames into 8 MiB disks, three times over


def fill_and_serve(store: TieredStore, first: str) -> dict:
    """Save REQUESTS requests, reading each one back and the first one again each time."""
    seen = {"saved": 0, "hit_latest": [], "wrong": []}
    for r in range(REQUESTS):
        keys = request_keys(f"{first}{r}", BLOCKS)
        ok = store.save(keys, [frame_for(k, SIZE) for k in keys])
        seen["saved"] += sum(ok)
        store.mover.drain()
        hits, wrong = load_checked(store, keys, SIZE)
        seen["hit_latest"].append(all(hits))
        seen["wrong"] += wrong
        seen["wrong"] += load_checked(store, request_keys(f"{first}0", BLOCKS), SIZE)[1]
    return seen


@pytest.mark.parametrize("full", ["nvme", "shared", "both"])
def test_full_disks_evict_and_keep_serving(tmp_path, tmpfs, full):
    nvme = tmpfs("nvme") if full in ("nvme", "both") else tmp_path / "nvme-disk"
    shared = tmpfs("shared") if full in ("shared", "both") else tmp_path / "shared-disk"
    nvme.mkdir(exist_ok=True)
    shared.mkdir(exist_ok=True)
    data = policy_dict(tmp_path, None, nvme=nvme / "kv", shared=shared / "kv",
                       nvme_capacity="64MiB", shared_capacity="64MiB")
    policy = make(data)
    with TieredStore(policy, node_id="node-a", mover=False) as store:
        seen = fill_and_serve(store, "full")
        counters = {t.name: t.counters() for t in store.tiers}
        stats = dict(store.mover.stats)
        copy_errors = stats.get("copy_errors", 0)
        fulls = sum(v for k, v in stats.items() if k.startswith("full_"))
        pending = store.index.pending_count()
        ready = {(e.key, e.tier) for e in store.index.scan(states=(READY,))}
        for tier in ("nvme", "shared"):  # every stored copy, read from its own tier
            keys = sorted(k for k, t in ready if t == tier)
            outs_ok = load_checked(store, keys, SIZE)
            assert outs_ok[1] == [], f"{tier}: wrong bytes"
    print(f"{full}: saved {seen['saved']} blocks, {sum(seen['hit_latest'])}/{REQUESTS} latest "
          f"requests hit, counters {counters}, mover {stats}")
    assert seen["wrong"] == []
    assert pending == 0
    assert not list(shared.rglob("*.tmp")), "a torn temp file was left behind"
    assert fulls + copy_errors > 0, "the disk never filled up: the test proves nothing"
    assert all(seen["hit_latest"][-20:]), "serving stopped once the disk was full"
    assert seen["saved"] == REQUESTS * BLOCKS  # the first tier took every save
    report = check_node(policy)
    assert report.clean, report.to_dict()
