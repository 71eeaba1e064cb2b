"""`FrameHold` alone (bounded copies, recycled slabs, a state machine), then the persist from
held frames on real tiers: a real master whose pool drops blocks, real files, real LMDB."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import make_policy
from kvtier.store.base import block
from kvtier.store.base.errors import TierUnavailableError
from kvtier.store.base.index import Index
from kvtier.store.base.keys import Namespace, block_keys
from kvtier.store.counters import read_counters
from kvtier.store.frame_hold import FrameHold
from kvtier.store.tiered import SessionHint, TieredStore
from kvtier.tiers import MISS

PAGE = block.PAGE
MiB = 1 << 20
NS = Namespace(model="frame-hold-test", chunk_tokens=16)


def frame_of(key: str, payload: int) -> memoryview:
    f = block.alloc_aligned(block.frame_size(payload, PAGE))
    f[block.HEADER_SIZE:block.HEADER_SIZE + payload] = random.Random(key).randbytes(payload)
    block.seal(f, key, payload)
    return f[:block.HEADER_SIZE + payload]


# ---- FrameHold ----------------------------------------------------------------------------

def test_hold_copies_within_the_budget_and_recycles_released_slabs():
    keys = block_keys(NS, range(16 * 6))
    frames = [frame_of(k, PAGE) for k in keys]  # frames of PAGE + 64 bytes: 2-page slabs
    hold = FrameHold(budget_bytes=5 * 2 * PAGE)
    assert hold.hold(keys, frames) == keys[:5]  # in order, up to the first that does not fit
    for f in frames:
        f[:] = bytes(len(f))  # the caller reuses its buffers once save returns
    got = hold.frames(keys)
    assert set(got) == set(keys[:5])
    for k in keys[:5]:
        assert block.verify(got[k], k).payload_len == PAGE
    assert hold.allocated_bytes() == 5 * 2 * PAGE
    hold.release(keys[:2])
    assert len(hold) == 3 and hold.frames(keys[:2]) == {}
    again = [frame_of(k, PAGE) for k in keys[5:]]
    assert hold.hold(keys[5:], again) == keys[5:]
    assert hold.allocated_bytes() == 5 * 2 * PAGE  # a released slab took it: no new memory


def test_a_held_key_keeps_its_copy_and_its_owner():
    key = block_keys(NS, range(16))[0]
    hold = FrameHold(budget_bytes=MiB)
    first = frame_of(key, 1000)
    assert hold.hold([key], [first]) == [key]
    assert hold.hold([key], [frame_of(key, 1000)]) == []  # already held: not this caller's
    assert bytes(hold.frames([key])[key]) == bytes(first)


def test_slabs_of_another_size_make_room_and_idle_slabs_are_unmapped():
    now = [0.0]
    hold = FrameHold(budget_bytes=4 * PAGE, clock=lambda: now[0])
    small, big = block_keys(NS, range(16 * 3))[:2], block_keys(NS, range(16 * 3))[2]
    assert hold.hold(small, [frame_of(k, 100) for k in small]) == small  # 2 one-page slabs
    hold.release(small)
    assert hold.hold([big], [frame_of(big, 3 * PAGE)]) == [big]  # 4 pages: the free go
    assert hold.allocated_bytes() == 4 * PAGE
    hold.release([big])
    assert hold.trim(idle_s=60) == 0  # held a moment ago
    now[0] = 61.0
    assert hold.trim(idle_s=60) == 4 * PAGE and hold.allocated_bytes() == 0


class HoldMachine(RuleBasedStateMachine):
    """Random holds and releases: copies stay intact, memory stays within the budget."""

    KEYS = block_keys(NS, range(16 * 8))

    def __init__(self):
        super().__init__()
        self.hold = FrameHold(budget_bytes=6 * PAGE)
        self.model: dict[str, bytes] = {}

    @rule(i=st.integers(0, 7), pages=st.integers(0, 3))
    def hold_one(self, i, pages):
        key = self.KEYS[i]
        frame = frame_of(key, pages * PAGE + 10)
        copied = self.hold.hold([key], [frame])
        if key in self.model:
            assert copied == []
        elif copied:
            self.model[key] = bytes(frame)
        frame[:] = bytes(len(frame))

    @rule(i=st.integers(0, 7))
    def release_one(self, i):
        self.hold.release([self.KEYS[i]])
        self.model.pop(self.KEYS[i], None)

    @invariant()
    def copies_intact_and_bounded(self):
        got = self.hold.frames(self.KEYS)
        assert {k: bytes(v) for k, v in got.items()} == self.model
        assert self.hold.held_bytes() <= self.hold.allocated_bytes() <= 6 * PAGE


TestHoldMachine = HoldMachine.TestCase
TestHoldMachine.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


# ---- persisting from held frames, on real tiers --------------------------------------------

def node_policy(root, master, pool="16MiB", **mover):
    return make_policy(
        root, master_address=master.address,
        mover={"interval_s": 0.05, "buffer": "64MiB", **mover},
        tiers=[{"name": "dram", "kind": "mooncake", "capacity": pool, "buffer": "16MiB",
                "staging": "8MiB"},
               {"name": "nvme", "kind": "nvme", "path": str(root / "nvme"),
                "capacity": "128MiB", "region_size": "4MiB"},
               {"name": "shared", "kind": "sharedfs", "path": str(root / "shared"),
                "capacity": "128MiB"}],
        admission={"kind": "always"})


def save_batch(store, keys, payload=MiB, session="s"):
    frames = [frame_of(k, payload) for k in keys]
    stored = store.save(keys, frames, SessionHint(session))
    for f in frames:
        f[:] = bytes(len(f))  # the connector reuses its staging as soon as save returns
    return stored


def loaded(store, keys, payload=MiB):
    outs = [block.alloc_aligned(block.frame_size(payload, PAGE)) for _ in keys]
    got = store.load(keys, outs)
    for key, out, n in zip(keys, outs, got):
        if n != MISS:
            body = bytes(out[block.HEADER_SIZE:block.HEADER_SIZE + n])
            assert body == random.Random(key).randbytes(payload)
    return got


def below(store, keys):
    return {t: sum(store.by_name[t].contains(keys)) for t in ("nvme", "shared")}


def test_blocks_the_pool_drops_before_the_mover_reaches_them_go_down_from_their_frames(
        tmp_path, shared_master):
    """One save larger than the pool (as a request's KV against a 25% pool): the master
    evicts part of it at once, the mover persists all of it from held copies, and after the
    pool is gone a lookup finds every block below, with its bytes."""
    policy = node_policy(tmp_path, shared_master)
    keys = block_keys(NS, range(16 * 24))  # 24 MiB of frames into a 16 MiB segment
    with TieredStore(policy, mover=False) as store:
        save_batch(store, keys)
        in_pool = store.tiers[0].contains(keys)
        assert not all(in_pool), "the pool kept the whole batch: nothing to show here"
        store.mover.drain()
        assert below(store, keys) == {"nvme": 24, "shared": 24}
        assert store.mover.stats["held"] == len(keys)  # refused ones included
        use = store.usage()
        assert use["dram"]["persist_misses"] == 0 and use["dram"]["unheld"] == 0
        assert use["nvme"]["from_frames"] == use["shared"]["from_frames"] == 24
        assert len(store.mover.hold) == 0  # released once copied
        gone = [k for k, held in zip(keys, in_pool) if not held]
        found = store.lookup(keys)
        assert found.hit_blocks == 24
        assert all(found.tiers[keys.index(k)] == "nvme" for k in gone)
        assert MISS not in loaded(store, keys)
    ix = Index(policy.index.path, readonly=True, recover=False)  # what `inspect --json` sums
    try:
        counters = read_counters(ix)
    finally:
        ix.close()
    assert counters["shared"]["from_frames"] == 24 and counters["dram"]["persist_misses"] == 0
    # Another process (the pool's segment went with the first): every block from below.
    with TieredStore(policy, mover=False) as store:
        found = store.lookup(keys)
        assert found.hit_blocks == 24 and "dram" not in found.tiers
        assert MISS not in loaded(store, keys)


def test_a_roomy_pool_is_read_back_and_its_saves_are_not_copied(tmp_path, shared_master):
    keys = block_keys(NS, range(16 * 8))
    with TieredStore(node_policy(tmp_path, shared_master, pool="64MiB"), mover=False) as store:
        assert save_batch(store, keys) == [True] * 8
        assert store.mover.stats["held"] == 0 and store.mover.hold.allocated_bytes() == 0
        store.mover.drain()
        assert below(store, keys) == {"nvme": 8, "shared": 8}
        use = store.usage()
        assert use["nvme"]["from_frames"] == 0 and use["dram"]["persist_misses"] == 0


def test_a_persist_miss_is_counted_and_the_next_saves_are_held(tmp_path, shared_master):
    """The pool drops a batch before the mover reads it (a delete, as the master's eviction
    does): those blocks are lost below, and `persist_misses` says so. Saves right after are
    held, even into a pool with room, and survive the same loss."""
    keys = block_keys(NS, range(16 * 8))
    first, then = keys[:4], keys[4:]
    with TieredStore(node_policy(tmp_path, shared_master, pool="64MiB"), mover=False) as store:
        save_batch(store, first)
        store.tiers[0].delete(first)
        store.mover.drain()
        assert store.usage()["dram"]["persist_misses"] == 4
        assert below(store, first) == {"nvme": 0, "shared": 0}
        save_batch(store, then)
        assert store.mover.stats["held"] == 4
        store.tiers[0].delete(then)
        store.mover.drain()
        assert below(store, then) == {"nvme": 4, "shared": 4}
        assert store.usage()["shared"]["from_frames"] == 4
        assert store.lookup(keys).hit_blocks == 0  # the first batch is gone from every tier
        assert store.lookup(then).hit_blocks == 4 and MISS not in loaded(store, then)


def test_with_no_hold_budget_saves_at_risk_are_read_back_and_counted(tmp_path, shared_master):
    """`mover.hold: 0` turns the copies off: after a persist miss the next saves are not
    held, `unheld` counts them, and a pool that drops them loses them below too."""
    keys = block_keys(NS, range(16 * 8))
    first, then = keys[:4], keys[4:]
    policy = node_policy(tmp_path, shared_master, pool="64MiB", hold="0")
    assert policy.mover.hold_bytes == 0
    with TieredStore(policy, mover=False) as store:
        save_batch(store, first)
        store.tiers[0].delete(first)
        store.mover.drain()
        save_batch(store, then)  # at risk now, but there is no budget to hold them
        assert store.mover.stats["held"] == 0 and store.usage()["dram"]["unheld"] == 4
        store.tiers[0].delete(then)
        store.mover.drain()
        assert below(store, then) == {"nvme": 0, "shared": 0}


def test_a_dropped_persist_releases_its_copies(tmp_path, shared_master):
    keys = block_keys(NS, range(16 * 24))
    policy = node_policy(tmp_path, shared_master, queue_blocks=8)
    with TieredStore(policy, mover=False) as store:
        save_batch(store, keys)
        assert store.mover.stats["persist_dropped"] == 24
        assert len(store.mover.hold) == 0 and store.mover.pending() == 0


def test_the_mover_thread_persists_held_frames_while_saves_go_on(tmp_path, shared_master):
    """The running mover, saves racing it: each batch bigger than half the pool."""
    keys = block_keys(NS, range(16 * 40))
    with TieredStore(node_policy(tmp_path, shared_master), mover=True) as store:
        for i in range(0, 40, 10):
            save_batch(store, keys[i:i + 10], session=f"s{i}")
        deadline = time.monotonic() + 60
        while store.mover.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert below(store, keys) == {"nvme": 40, "shared": 40}
        assert store.lookup(keys).hit_blocks == 40
        assert MISS not in loaded(store, keys)


def test_a_persist_goes_before_the_promotions_queued_ahead_of_it(tmp_path, shared_master):
    """Loads from below queue promotions of whole prefixes; a save made after them reaches
    the shared tier (where other nodes look) before they are done."""
    old, new = block_keys(NS, range(16 * 52))[:48], block_keys(NS, range(16 * 52))[48:]
    with TieredStore(node_policy(tmp_path, shared_master, pool="64MiB"), mover=False) as store:
        save_batch(store, old)
        store.mover.drain()
        store.tiers[0].delete(old)
        store.placement.on_remove(store.tiers[0], old)
        for i in range(0, 48, 8):
            assert MISS not in loaded(store, old[i:i + 8])  # from nvme: 6 promotions queued
        save_batch(store, new, session="t")
        assert store.mover.pending() == 52
        worker = threading.Thread(target=store.mover.drain)
        worker.start()
        try:
            while not all(store.by_name["shared"].contains(new)):
                assert worker.is_alive(), "the persist went last"
                time.sleep(0.005)
            assert store.mover.pending() > len(new)  # promotions still queued behind it
        finally:
            worker.join()
        assert all(store.tiers[0].contains(old[-8:]))  # and the promotions ran after


def test_a_block_evicted_before_its_persist_goes_to_the_shared_tier_with_its_demotion(
        tmp_path, shared_master):
    """A save below the pool's risk line is not held; a second save evicts part of it before
    the mover reached its persist. The demotion writes those blocks to the shared tier as
    well as to this node's nvme, so another node finds them at once, not after the persist."""
    first, second = block_keys(NS, range(16 * 20))[:10], block_keys(NS, range(16 * 20))[10:]
    with TieredStore(node_policy(tmp_path, shared_master), mover=False) as store:
        save_batch(store, first, session="a")
        assert store.mover.stats["held"] == 0  # 10 of 16 MiB: under the risk line
        save_batch(store, second, session="b")  # make room: part of `first` is evicted
        gone = [k for k, has in zip(first, store.tiers[0].contains(first)) if not has]
        assert gone
        assert below(store, gone) == {"nvme": len(gone), "shared": len(gone)}
        assert store.mover.stats["demote_unpersisted_shared"] == len(gone)
        store.mover.drain()
        assert below(store, first + second) == {"nvme": 20, "shared": 20}
        assert MISS not in loaded(store, first + second)


def test_a_demotion_writes_nothing_again_to_the_shared_tier_its_persist_reached(
        tmp_path, shared_master):
    first, second = block_keys(NS, range(16 * 20))[:10], block_keys(NS, range(16 * 20))[10:]
    with TieredStore(node_policy(tmp_path, shared_master), mover=False) as store:
        save_batch(store, first, session="a")
        store.mover.drain()  # persisted: in nvme and shared
        puts = store.by_name["shared"].counters()["puts"]
        save_batch(store, second, session="b")
        assert not all(store.tiers[0].contains(first))  # evicted
        assert store.mover.stats["demote_unpersisted_shared"] == 0
        assert store.by_name["shared"].counters()["puts"] == puts


def test_a_block_whose_demotion_missed_the_shared_tier_reaches_it_with_its_persist(
        tmp_path, shared_master, monkeypatch):
    """The shared tier does not answer while a save evicts blocks not yet persisted (a
    network mount that hangs: mocked, as a test cannot hang a mount for a moment): they
    are demoted to nvme only. Their persist, once the tier is back, copies them on from
    nvme, as they are gone from the pool."""
    first, second = block_keys(NS, range(16 * 20))[:10], block_keys(NS, range(16 * 20))[10:]
    with TieredStore(node_policy(tmp_path, shared_master), mover=False) as store:
        shared = store.by_name["shared"]
        save_batch(store, first, session="a")
        with monkeypatch.context() as m:
            def hung(keys, frames):
                raise TierUnavailableError("sharedfs tier 'shared': the mount hangs")
            m.setattr(shared, "put", hung)
            save_batch(store, second, session="b")
        gone = [k for k, has in zip(first, store.tiers[0].contains(first)) if not has]
        assert gone and below(store, gone) == {"nvme": len(gone), "shared": 0}
        store.mover.drain()
        assert below(store, first + second) == {"nvme": 20, "shared": 20}
        assert MISS not in loaded(store, first + second)
