"""Crashes on the store's save path: a writer process (`TieredStore.save`, the mover
persisting to nvme and sharedfs) killed with SIGKILL at random points, then restarted.

After every kill, before anything recovers:
- `check_node` finds nothing but what a dead writer leaves behind (`DEAD_WRITER_LEFTOVERS`:
  its PENDING reservations, its temp files, and sharedfs files renamed into place before
  their entry was committed), every one of them explained by the snapshot of the index;
- on even points `check_node(fix=True)` removes exactly those and checks clean; on odd
  points the next writer's own recovery (at open) does the same job;
- nothing that was PENDING is served, every READY entry is readable with its exact bytes,
  and every block any writer reported saved is either a miss or its exact bytes.
At the end a clean run, then `check_node` with the pool: clean, and every block that was
ever committed READY is still there, byte for byte (the tiers are big enough that nothing
is evicted, so a missing one would be a lost update).
"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from fault_util import (KiB, Child, load_checked, make, policy_dict, payload_for, out_for,
                        without_pool)
from conftest import start_master
from kvtier.store.base import block
from kvtier.store.base.index import Index
from kvtier.store.base.index_record import PENDING, READY
from kvtier.store.check.node import check_node
from kvtier.store.tiered import TieredStore
from kvtier.tiers import MISS

SIZE = 64 * KiB
BLOCKS = 8
# What a SIGKILLed writer may leave, and why it is harmless: a PENDING entry (never served,
# dropped by the next open or --fix), a temp file (never read, swept), a complete sharedfs
# file whose commit did not happen (a valid frame of its key; --fix or gc removes it).
DEAD_WRITER_LEFTOVERS = {"pending", "stale_temp", "orphan"}


class Ledger:
    """What the writers reported and what the index committed, across all kill points."""

    def __init__(self):
        self.saved: set[str] = set()
        self.committed: set[tuple[str, str]] = set()
        self.next_request = 0
        self.kinds: Counter = Counter()

    def take(self, msg: dict) -> None:
        if "saved" in msg:
            self.saved.update(msg["keys"])
            self.next_request = max(self.next_request, int(msg["saved"][1:]) + 1)
        assert not msg.get("wrong"), f"a writer read wrong bytes: {msg}"


def kill_at_random(data: dict, ledger: Ledger, rng: random.Random, log) -> None:
    child = Child("store_writer.py", {"policy": data, "first": ledger.next_request,
                                      "forever": True, "size": SIZE, "blocks": BLOCKS,
                                      "seed": rng.randrange(1 << 30)}, log=log)
    try:
        assert "ready" in child.expect(90)
        steps = rng.randint(1, 8)  # saves and reads reported before the kill
        for _ in range(steps):
            ledger.take(child.expect(60))
        time.sleep(rng.uniform(0, 0.08))  # the kill lands somewhere inside the next step
        child.kill()
        while (msg := child.read(10)) is not None:  # reported before it died: it happened
            ledger.take(msg)
    finally:
        child.close()


def snapshot(policy) -> tuple[set, set]:
    """(PENDING, READY) (key, tier) pairs, read without recovering anything."""
    ix = Index(policy.index.path, readonly=True, recover=False)
    try:
        pending = {(e.key, e.tier) for e in ix.scan(states=(PENDING,))}
        ready = {(e.key, e.tier) for e in ix.scan(states=(READY,))}
    finally:
        ix.close()
    return pending, ready


def check_after_kill(data: dict, ledger: Ledger, fix: bool) -> None:
    policy = make(without_pool(data))  # the pool died with the writer's segment
    pending, ready = snapshot(policy)
    report = check_node(policy)
    ledger.kinds.update(p.kind for p in report.problems)
    assert {p.kind for p in report.problems} <= DEAD_WRITER_LEFTOVERS, report.to_dict()
    for p in report.problems:
        if p.kind == "pending":
            assert (p.key, p.tier) in pending, p
    if fix:
        fixed = check_node(policy, fix=True)
        assert fixed.clean, fixed.to_dict()
    ledger.committed |= ready
    with TieredStore(policy, node_id="verifier", mover=False) as store:
        for tier in ("nvme", "shared"):
            was_pending = [k for k, t in pending if t == tier and (k, t) not in ready]
            entries = store.index.get(tier, was_pending, ready_only=False)
            assert entries == [None] * len(was_pending), "a dead writer's PENDING survived"
        assert_tier_bytes(store, ready)
        hits, wrong = load_checked(store, sorted(ledger.saved), SIZE)
        assert wrong == [], f"wrong bytes served for {wrong[:3]}"


def assert_tier_bytes(store: TieredStore, pairs) -> None:
    """Each (key, tier) is served by that very tier with its exact bytes."""
    for tier in ("nvme", "shared"):
        keys = sorted(k for k, t in pairs if t == tier)
        outs = [out_for(SIZE) for _ in keys]
        got = store.by_name[tier].get(keys, outs)
        lost = [k for k, n in zip(keys, got) if n == MISS]
        assert not lost, f"{len(lost)} committed blocks of {tier} are gone, e.g. {lost[:2]}"
        bad = [k for k, o in zip(keys, outs)
               if bytes(o[block.HEADER_SIZE:block.HEADER_SIZE + SIZE]) != payload_for(k, SIZE)]
        assert not bad, f"{tier} served wrong bytes for {bad[:2]}"


def crash_cycle(tmp_path, points: int, seed: int) -> Ledger:
    master = start_master(tmp_path)
    try:
        data = policy_dict(tmp_path, master.address, nvme_capacity="256MiB",
                           shared_capacity="512MiB")
        rng, ledger = random.Random(seed), Ledger()
        with open(tmp_path / "writers.log", "ab") as log:
            for point in range(points):
                kill_at_random(data, ledger, rng, log.name)
                check_after_kill(data, ledger, fix=point % 2 == 0)
        final = Child("store_writer.py", {"policy": data, "first": ledger.next_request,
                                          "count": 3, "size": SIZE, "blocks": BLOCKS})
        try:
            for msg in final.finish():
                ledger.take(msg)
        finally:
            final.close()
        report = check_node(make(data))  # the whole node, pool included
        assert report.clean and set(report.skipped) <= {"dram"}, report.to_dict()
        with TieredStore(make(without_pool(data)), node_id="verifier", mover=False) as store:
            assert_tier_bytes(store, ledger.committed)
            hits, wrong = load_checked(store, sorted(ledger.saved), SIZE)
            assert wrong == []
            assert sum(hits) >= len(ledger.committed) // 2  # sanity: the run persisted blocks
    finally:
        master.stop()
    print(f"kill points: {points}, leftovers seen by check: {dict(ledger.kinds)}, "
          f"blocks saved: {len(ledger.saved)}, committed copies: {len(ledger.committed)}")
    return ledger


def test_writer_killed_at_random_points_recovers_clean(tmp_path):
    ledger = crash_cycle(tmp_path, points=10, seed=7)
    assert ledger.committed and ledger.saved


@pytest.mark.slow
def test_writer_killed_at_fifty_random_points_recovers_clean(tmp_path):
    ledger = crash_cycle(tmp_path, points=50, seed=11)
    assert ledger.committed and ledger.saved
