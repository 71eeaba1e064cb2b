"""TieredStore on real tiers (a real master, real files, real LMDB): the data path, the
mover, and a hypothesis state machine over small tiers."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import make_policy
from kvtier.store.base import block
from kvtier.store.base.index_record import READY
from kvtier.store.base.keys import Namespace, block_keys
from kvtier.store.tiered import SessionHint, TieredStore
from kvtier.tiers import MISS

PAYLOAD = 200_000
NS = Namespace(model="tiered-test", chunk_tokens=16)


def payload_of(key: str) -> bytes:
    return random.Random(key).randbytes(PAYLOAD)


def frames_for(keys):
    out = []
    for key in keys:
        f = block.alloc_aligned(block.frame_size(PAYLOAD, block.PAGE))
        f[block.HEADER_SIZE:block.HEADER_SIZE + PAYLOAD] = payload_of(key)
        block.seal(f, key, PAYLOAD)
        out.append(f)
    return out


def outs_for(n):
    return [block.alloc_aligned(block.frame_size(PAYLOAD, block.PAGE)) for _ in range(n)]


def small_policy(root, master, eviction=None, **mover):
    extra = {"eviction": eviction} if eviction else {}
    return make_policy(
        root, master_address=master.address, **extra,
        mover={"interval_s": 0.05, "buffer": "8MiB", **mover},
        tiers=[
            {"name": "dram", "kind": "mooncake", "capacity": "16MiB", "buffer": "16MiB",
             "staging": "8MiB"},
            {"name": "nvme", "kind": "nvme", "path": str(root / "nvme"), "capacity": "8MiB",
             "region_size": "1MiB"},
            {"name": "shared", "kind": "sharedfs", "path": str(root / "shared"),
             "capacity": "64MiB"},
        ],
        admission={"kind": "always"})


def check_loaded(store, keys, where=None):
    outs = outs_for(len(keys))
    got = store.load(keys, outs, where)
    for key, out, n in zip(keys, outs, got):
        if n != MISS:
            assert n == PAYLOAD
            assert bytes(out[block.HEADER_SIZE:block.HEADER_SIZE + n]) == payload_of(key)
    return got


def test_save_lookup_load_and_persist(tmp_path, shared_master):
    keys = block_keys(NS, range(16 * 8))
    with TieredStore(small_policy(tmp_path, shared_master), mover=False) as store:
        assert store.lookup(keys).hit_blocks == 0
        assert store.save(keys, frames_for(keys), SessionHint("s")) == [True] * 8
        assert store.save(keys[:2], frames_for(keys[:2])) == [True, True]  # dedup: present
        assert store.tiers[0].counters()["puts"] == 8
        found = store.lookup(keys)
        assert found.hit_blocks == 8 and set(found.tiers) == {"dram"}
        assert check_loaded(store, keys) == [PAYLOAD] * 8
        store.mover.drain()  # persist to the capacity tiers
        for tier in ("nvme", "shared"):
            assert all(store.by_name[tier].contains(keys))
        # The pool loses the blocks: lookups and loads fall through to nvme, and promote.
        store.tiers[0].delete(keys)
        found = store.lookup(keys)
        assert found.hit_blocks == 8 and set(found.tiers) == {"nvme"}
        # `where`: each key on its own, not a prefix
        other = block_keys(NS, range(5000, 5000 + 16))
        assert store.where([other[0], keys[3], other[0], keys[0]]) == [None, "nvme", None,
                                                                       "nvme"]
        assert check_loaded(store, keys) == [PAYLOAD] * 8
        store.mover.drain()
        assert all(store.tiers[0].contains(keys))


def test_load_asks_the_tier_the_lookup_named_first(tmp_path, shared_master):
    keys = block_keys(NS, range(16 * 4))
    with TieredStore(small_policy(tmp_path, shared_master), mover=False) as store:
        store.save(keys, frames_for(keys))
        store.mover.drain()  # every block in dram, nvme and shared
        store.by_name["shared"].delete([keys[3]])  # a hint gone stale
        tiers = {t.name: t for t in store.tiers}
        before = {name: t.counters() for name, t in tiers.items()}
        got = check_loaded(store, keys, ["nvme", "nvme", "dram", "shared"])
        assert got == [PAYLOAD] * 4
        moved = {name: {k: t.counters()[k] - before[name][k] for k in ("hits", "misses")}
                 for name, t in tiers.items()}
        # the pool is never asked for the blocks found on nvme; the stale one falls back to
        # the fastest tier that has it
        assert moved == {"dram": {"hits": 2, "misses": 0}, "nvme": {"hits": 2, "misses": 0},
                         "shared": {"hits": 0, "misses": 1}}
        with pytest.raises(ValueError, match="tier hints"):
            store.load(keys, outs_for(4), ["dram"])


def test_prefix_stops_at_the_first_missing_block(tmp_path, shared_master):
    keys = block_keys(NS, range(16 * 6))
    with TieredStore(small_policy(tmp_path, shared_master), mover=False) as store:
        store.save(keys, frames_for(keys))
        store.tiers[0].delete([keys[2]])
        assert store.lookup(keys).hit_blocks == 2
        store.save([keys[2]], frames_for([keys[2]]))
        assert store.lookup(keys).hit_blocks == 6


def test_blocks_the_caller_holds_are_not_looked_for(tmp_path, shared_master):
    keys = block_keys(NS, range(16 * 6))
    with TieredStore(small_policy(tmp_path, shared_master), mover=False) as store:
        store.save(keys[2:], frames_for(keys[2:]))  # the first two only the caller has
        asked = []
        for tier in store.tiers:
            real = tier.contains
            tier.contains = lambda ks, real=real: asked.extend(ks) or real(ks)
        found = store.lookup(keys, held=2)
        assert found.hit_blocks == 6 and found.tiers == (None, None, *["dram"] * 4)
        assert asked == keys[2:]  # one pool query, for the blocks past the local hit
        pinned = store.placement._pins
        assert keys[0] not in pinned and all(k in pinned for k in keys[2:])
        asked.clear()
        assert store.lookup(keys, held=6).hit_blocks == 6 and asked == []
        assert store.lookup(keys).hit_blocks == 0  # asked from the first, the prefix breaks
        with pytest.raises(ValueError, match="held=7"):
            store.lookup(keys, held=7)


def test_a_lookup_asks_the_tiers_below_the_pool_only_up_to_the_end_of_the_prefix(
        tmp_path, shared_master):
    """The pool is asked about every key (one query); nvme and sharedfs only from the first
    key the pool lacks, in growing windows, up to the first key no tier holds: a cold prompt
    costs them one window, and the answer is the prefix every tier asked about every key
    gives."""
    from kvtier.store.tiered import PREFIX_WINDOW
    keys = block_keys(NS, range(16 * 100))
    with TieredStore(small_policy(tmp_path, shared_master), mover=False) as store:
        asked = {t.name: [] for t in store.tiers}
        for tier in store.tiers:
            real = tier.contains
            tier.contains = lambda ks, real=real, n=tier.name: asked[n].extend(ks) or real(ks)

        def lookup():
            for got in asked.values():
                got.clear()
            return store.lookup(keys)

        found = lookup()
        assert found.hit_blocks == 0 and len(asked["dram"]) == len(keys)
        assert asked["nvme"] == asked["shared"] == keys[:PREFIX_WINDOW]
        # the pool holds 0-9, nvme 10-29 (and 70), sharedfs 30-49: the prefix is 50
        for name, part in (("dram", keys[:10]), ("nvme", keys[10:30] + [keys[70]]),
                           ("shared", keys[30:50])):
            assert all(store.by_name[name].put(part, frames_for(part)))
        found = lookup()
        assert found.hit_blocks == 50
        assert found.tiers == ("dram",) * 10 + ("nvme",) * 20 + ("shared",) * 20
        # windows of 16 then 64 from key 10: nvme is asked about keys 10-89, sharedfs only
        # about those nvme lacks; no tier about a key past the window the prefix ends in
        assert asked["nvme"] == keys[10:90]
        assert asked["shared"] == keys[30:70] + keys[71:90]
        assert found.tiers == tuple(store.where(keys)[:50])  # every tier, every key


def test_a_hung_shared_filesystem_does_not_hold_lookups(tmp_path, shared_master, monkeypatch):
    """A lookup whose sharedfs mount hangs (injected: a stat that does not return, as on a
    hard mount whose server is gone) answers from the other tiers after the tier's
    `call_timeout_s`, and the next lookups at once."""
    import threading
    from kvtier.tiers.sharedfs import files
    keys = block_keys(NS, range(16 * 8))
    policy = small_policy(tmp_path, shared_master)
    shared = {"name": "shared", "kind": "sharedfs", "path": str(tmp_path / "shared"),
              "capacity": "64MiB", "call_timeout_s": 0.3}
    policy = make_policy(tmp_path, master_address=shared_master.address,
                         tiers=[*[t.model_dump(by_alias=True) for t in policy.tiers[:2]],
                                shared], admission={"kind": "always"})
    release = threading.Event()
    real = files.is_file
    with TieredStore(policy, mover=False) as store:
        store.save(keys[:4], frames_for(keys[:4]))
        stats = []
        monkeypatch.setattr(files, "is_file",
                            lambda p: stats.append(p) or (release.wait(30) and real(p)))
        try:
            t0 = time.monotonic()
            found = store.lookup(keys)
            assert found.hit_blocks == 4 and found.tiers == ("dram",) * 4
            assert time.monotonic() - t0 < 5  # not the 30 s the stat hangs
            assert len(stats) == 1  # the first stat hangs
            found = store.lookup(keys)  # skips the tier: no stat while that one hangs
            assert found.hit_blocks == 4 and len(stats) == 1
        finally:
            release.set()


def test_reopen_finds_persisted_blocks(tmp_path, shared_master):
    keys = block_keys(NS, range(16 * 4))
    policy = small_policy(tmp_path, shared_master)
    with TieredStore(policy, mover=False) as store:
        store.save(keys, frames_for(keys))
        store.mover.drain()
    # The process's pool segment went away with its client; nvme and sharedfs remain.
    with TieredStore(policy, mover=False) as store:
        found = store.lookup(keys)
        assert found.hit_blocks == 4 and "dram" not in found.tiers
        assert check_loaded(store, keys) == [PAYLOAD] * 4


def test_watermark_demotes_instead_of_dropping(tmp_path, shared_master):
    policy = small_policy(tmp_path, shared_master)
    with TieredStore(policy, mover=False) as store:
        cap = store.tiers[0].capacity_bytes
        frame = block.frame_size(PAYLOAD)
        n = int(cap * 1.5 // frame)
        keys = block_keys(NS, range(16 * n))
        for i in range(0, n, 8):
            store.save(keys[i:i + 8], frames_for(keys[i:i + 8]), SessionHint(f"s{i}"))
            store.mover.drain()
        store.mover.tick()
        assert store.tiers[0].used_bytes() <= policy.mover.high_watermark * cap
        assert store.mover.stats["evicted_dram"] > 0
        found = store.lookup(keys)
        assert found.hit_blocks == n  # every block is still somewhere
        assert check_loaded(store, keys) == [PAYLOAD] * n


def test_the_mover_keeps_the_pool_under_its_watermarks_of_what_the_pool_can_hold(
        tmp_path, shared_master, monkeypatch):
    """Where the pool has shown it refuses puts before its capacity (`usable_bytes`), the
    watermarks are fractions of that: the mover evicts before the master would, by its
    own policy, demoting what it evicts, instead of the master dropping blocks on its own."""
    policy = small_policy(tmp_path, shared_master)
    with TieredStore(policy, mover=False) as store:
        pool = store.tiers[0]
        usable = int(0.6 * pool.capacity_bytes)
        monkeypatch.setattr(pool, "usable_bytes", lambda: usable)  # as after a refused put
        frame = block.frame_size(PAYLOAD)
        n = int(pool.capacity_bytes * 0.85 // frame)  # under the capacity's watermark
        keys = block_keys(NS, range(16 * n))
        for i in range(0, n, 4):
            store.save(keys[i:i + 4], frames_for(keys[i:i + 4]), SessionHint(f"s{i}"))
            store.mover.drain()
            assert pool.used_bytes() <= policy.mover.high_watermark * usable + frame
        store.mover.tick()
        assert pool.used_bytes() <= policy.mover.high_watermark * usable
        assert store.mover.stats["evicted_dram"] > 0
        assert store.lookup(keys).hit_blocks == n  # demoted, not dropped
        assert check_loaded(store, keys) == [PAYLOAD] * n


def test_a_pool_with_nothing_below_is_left_to_the_masters_eviction(tmp_path, shared_master):
    """With no tier below, a victim has nowhere to go, and this process ranks only its own
    blocks by its own reads: the store evicts nothing from the pool and the master does
    (its order sees every client's reads). Its policy forgets what it tracks beyond the
    pool's capacity, so its state stays bounded while the master drops blocks unseen."""
    policy = make_policy(
        tmp_path, master_address=shared_master.address,
        mover={"interval_s": 0.05, "buffer": "8MiB"},
        tiers=[{"name": "dram", "kind": "mooncake", "capacity": "16MiB", "buffer": "16MiB",
                "staging": "8MiB"}])
    with TieredStore(policy, mover=False) as store:
        dram = store.tiers[0]
        cap = dram.capacity_bytes
        frame = block.frame_size(PAYLOAD)
        n = int(cap * 2 // frame)
        keys = block_keys(NS, range(16 * n))
        stored = []
        for i in range(0, n, 4):
            stored += store.save(keys[i:i + 4], frames_for(keys[i:i + 4]), SessionHint("s"))
            store.mover.drain()
            store.mover.tick()
        assert store.mover.stats["evicted_dram"] == 0  # the store deleted nothing
        assert dram.counters()["deletes"] == 0
        assert sum(stored) == n  # every save landed: the master made room itself
        present = dram.contains(keys)
        assert 0 < sum(present) < n  # it dropped the excess, and only that
        assert store.placement.tracked_bytes(dram) <= cap
        assert check_loaded(store, [k for k, p in zip(keys, present) if p]) == \
            [PAYLOAD] * sum(present)


def test_blocks_gone_from_every_tier_are_forgotten(tmp_path, shared_master):
    """The store's size memo lets go of a block no tier holds any more (it used to keep
    every block it ever tracked: a leak over a server's lifetime)."""
    keys = block_keys(NS, range(16 * 4))
    with TieredStore(small_policy(tmp_path, shared_master), mover=False) as store:
        store.save(keys, frames_for(keys))
        store.mover.drain()
        assert set(keys) <= set(store.placement._sizes)
        for tier in store.tiers[:-1]:  # each tier down to the next, then out of the last
            store.mover.demote(tier, keys)
            assert set(keys) <= set(store.placement._sizes), tier.name
        store.mover.demote(store.tiers[-1], keys)
        assert store.lookup(keys).hit_blocks == 0
        assert not set(keys) & set(store.placement._sizes)


def test_lookups_never_finished_or_loaded_leave_nothing_behind(tmp_path, shared_master,
                                                               monkeypatch):
    """A lookup pins the blocks it promises and opens a request; when the load happens in
    another process (vLLM's multi-process engine) or the request is looked up again with a
    longer chain (resumed after preemption), neither is cleared by the data path. Pins expire
    on the mover's tick without any eviction pressure; open requests are bounded."""
    from kvtier.store import placement
    monkeypatch.setattr(placement, "MAX_OPEN_REQUESTS", 8)
    now = [10_000.0]
    keys = block_keys(NS, range(16 * 4))
    with TieredStore(small_policy(tmp_path, shared_master), mover=False,
                     clock=lambda: now[0]) as store:
        store.save(keys, frames_for(keys))
        assert store.lookup(keys).hit_blocks == 4
        assert set(store.placement._pins) == set(keys)
        now[0] += placement.PIN_S + 1
        store.mover.tick()
        assert store.placement._pins == {}
        for n in range(1, 20):  # one chain growing, looked up again and again, never finished
            chain = block_keys(NS, range(16 * (4 + n)))
            store.lookup(chain)
        assert len(store.placement._open) == 8


def test_session_rows_follow_blocks_that_land_or_move_after_the_turn(tmp_path, shared_master,
                                                                     monkeypatch):
    """A turn's end writes its session's row (what `inspect sessions` reads), but the saves of
    that turn can land after it (vLLM's workers save on their I/O thread), and blocks move
    down later. The mover's tick rewrites the rows of the sessions whose blocks moved."""
    from kvtier.store import mover
    from kvtier.store.sessions.persist import read_sessions
    monkeypatch.setattr(mover, "ROWS_EVERY_S", 0.0)
    keys = block_keys(NS, range(16 * 4))
    hint = SessionHint("agent-7")

    def row():
        store.flush_sessions()  # rows are written off the caller's thread
        return {sid: rec for sid, rec, _ in read_sessions(store.index)}["agent-7"]

    with TieredStore(small_policy(tmp_path, shared_master), mover=False) as store:
        store.lookup(keys, hint)
        store.finish(keys, hint)  # the turn ended before any of its blocks landed
        assert row()["blocks_per_tier"] == {"dram": 0, "nvme": 0, "shared": 0}
        store.save(keys, frames_for(keys), hint)
        store.mover.drain()
        assert row()["blocks_per_tier"] == {"dram": 0, "nvme": 0, "shared": 0}  # until a tick
        store.mover.tick()
        assert row()["blocks_per_tier"] == {"dram": 4, "nvme": 4, "shared": 4}
        store.mover.demote(store.tiers[0], keys)
        store.mover.tick()
        assert row()["blocks_per_tier"] == {"dram": 0, "nvme": 4, "shared": 4}
        assert store.placement.refresh_rows() == 0  # nothing moved since


def test_a_stopping_mover_finishes_persists_and_drops_promotions(tmp_path, shared_master):
    """vLLM gives a stopping worker a few seconds: the mover writes what only the pool holds
    and drops the lifts into a store about to close (their source keeps the blocks)."""
    lifted, fresh = block_keys(NS, range(16 * 4)), block_keys(NS, range(1000, 1000 + 16 * 4))
    with TieredStore(small_policy(tmp_path, shared_master), mover=False) as store:
        dram, nvme = store.tiers[0], store.by_name["nvme"]
        store.save(lifted, frames_for(lifted))
        store.mover.drain()
        store.mover.demote(dram, lifted)
        store.mover.promote(lifted, "nvme")
        store.save(fresh, frames_for(fresh))
        assert store.mover.pending() == 8
        store.mover.stop()
        assert store.mover.pending() == 4 and store.mover.stats["promote_dropped_at_stop"] == 4
        store.mover.drain()
        assert nvme.contains(fresh) == [True] * 4
        assert dram.contains(lifted) == [False] * 4 and nvme.contains(lifted) == [True] * 4
        assert check_loaded(store, lifted) == [PAYLOAD] * 4


def tick_until_prefetching(store, now, steps=400):
    """Advance the fake clock in 0.1 ms steps, ticking the mover, until it queues a
    prefetch (bounded)."""
    for _ in range(steps):
        now[0] += 0.0001
        store.mover.tick()
        if store.mover.pending():
            return
    raise AssertionError("the demoted session never became due for prefetch")


def test_a_session_coming_back_again_is_prefetched_again(tmp_path, shared_master):
    """Each return of a demoted session lifts its blocks: the in-flight mark ends with the
    promotion, and blocks the pool already holds are not offered (they used to stay marked
    for good, so a session was prefetched once in its life)."""
    now = [10_000.0]
    policy = small_policy(tmp_path, shared_master, eviction={"kind": "agentic"})
    keys = block_keys(NS, range(16 * 4))
    # Agentic lifts a session once the time left to its likely return is down to the time a
    # restore takes: for 4 small blocks from nvme that is under a millisecond, so the gap
    # is a few milliseconds and the clock moves in steps of a tenth of one.
    hint = SessionHint("agent", expected_gap_s=0.002)
    with TieredStore(policy, mover=False, clock=lambda: now[0]) as store:
        dram, nvme = store.tiers[0], store.by_name["nvme"]
        store.lookup(keys, hint)
        store.save(keys, frames_for(keys), hint)
        store.mover.drain()  # persisted below
        store.finish(keys, hint)

        for round_ in range(3):
            store.mover.demote(dram, keys)
            assert dram.contains(keys) == [False] * 4 and nvme.contains(keys) == [True] * 4
            tick_until_prefetching(store, now)
            assert store.mover.pending() == 4, round_
            store.mover.drain()
            assert dram.contains(keys) == [True] * 4, round_
            store.mover.tick()
            assert store.mover.pending() == 0  # in the pool already: not offered again
        assert nvme.contains(keys) == [True] * 4


def test_blocks_another_node_lifted_are_not_asked_about_every_tick(tmp_path, shared_master):
    """Node b wants its session's blocks back in the pool, but node a has put them there
    already: b's mover finds them present, copies nothing, and does not offer them again
    on the next ticks (each offer costs a pool query)."""
    now = [10_000.0]
    keys = block_keys(NS, range(16 * 4))
    hint = SessionHint("agent", expected_gap_s=0.002)  # see the test above for the scale
    with TieredStore(small_policy(tmp_path / "b", shared_master, eviction={"kind": "agentic"}),
                     node_id="b", mover=False, clock=lambda: now[0]) as b, \
            TieredStore(small_policy(tmp_path / "a", shared_master), node_id="a",
                        mover=False) as a:
        b.lookup(keys, hint)
        b.save(keys, frames_for(keys), hint)
        b.mover.drain()
        b.finish(keys, hint)
        b.mover.demote(b.tiers[0], keys)
        assert b.tiers[0].contains(keys) == [False] * 4
        a.save(keys, frames_for(keys))  # a lifts them first
        tick_until_prefetching(b, now)
        assert b.mover.pending() == 4
        copied = b.mover.copier.stats.get("copied_nvme_dram", 0)
        b.mover.drain()
        assert b.mover.copier.stats.get("copied_nvme_dram", 0) == copied  # nothing to copy
        for _ in range(5):
            now[0] += 0.0001
            b.mover.tick()
            assert b.mover.pending() == 0


def test_processes_sharing_a_pool_service_free_its_excess_once(tmp_path, mooncake_master):
    """Two nodes of one host join one pool service: both read the same segment's usage.
    When it passes the high watermark each frees its own share of the excess, so the excess
    is freed once (each freeing all of it emptied the pool by the excess once per node).
    Each node has a tier below the pool: with none, the master does the evicting."""
    from kvtier.tiers.mooncake.master import free_port
    from kvtier.tiers.mooncake.service import PoolService

    def policy(name, service):
        return make_policy(
            tmp_path / name, master_address=mooncake_master.address,
            master={"address": mooncake_master.address, "embedded": False,
                    "extra_flags": {"metrics_port": str(mooncake_master.metrics_port)},
                    "run_dir": str(tmp_path / "run")},  # where the service names its segment
            mover={"interval_s": 0.05, "buffer": "8MiB"}, admission={"kind": "always"},
            tiers=[{"name": "dram", "kind": "mooncake", "capacity": "16MiB",
                    "buffer": "16MiB", "staging": "8MiB", "service": service,
                    "service_embedded": False},
                   {"name": "shared", "kind": "sharedfs", "path": str(tmp_path / "shared"),
                    "capacity": "64MiB"}])

    address = f"127.0.0.1:{free_port()}"
    svc_cfg = policy("svc", address)
    with PoolService(svc_cfg.tiers[0], svc_cfg.master) as _svc, \
            TieredStore(policy("a", address), node_id="a", mover=False) as a, \
            TieredStore(policy("b", address), node_id="b", mover=False) as b:
        frame = block.frame_size(PAYLOAD, block.PAGE)
        per_node = int(0.93 * (16 << 20) / frame) // 2  # together above the 90% watermark
        keys = block_keys(NS, range(16 * 2 * per_node))
        a.save(keys[:per_node], frames_for(keys[:per_node]))
        b.save(keys[per_node:], frames_for(keys[per_node:]))
        for s in (a, b):
            s.tiers[0].usage.refresh()
        used = a.tiers[0].used_bytes()
        assert used == b.tiers[0].used_bytes() > 0.9 * (16 << 20)
        assert 0.4 < a.tiers[0].own_share(used) < 0.6 and 0.4 < b.tiers[0].own_share(used) < 0.6
        excess = used - 0.8 * (16 << 20)
        for s in (a, b):
            s.mover.tick()
            s.tiers[0].usage.refresh()
        freed = sum(s.mover.stats.get("evicted_dram", 0) for s in (a, b))
        # Whole frames: each node rounds its share up by at most one.
        assert excess / frame <= freed <= excess / frame + 2
        held = a.tiers[0].contains(keys)
        assert sum(held) == 2 * per_node - freed
        assert a.tiers[0].used_bytes() <= 0.9 * (16 << 20)


class TieredMachine(RuleBasedStateMachine):
    """Random sessions, loads, ticks, pool losses and reopens against small tiers."""

    master = None
    root = None

    def __init__(self):
        super().__init__()
        import tempfile
        from pathlib import Path
        self.dir = Path(tempfile.mkdtemp(dir=self.root))
        self.policy = small_policy(self.dir, self.master)
        self.store = TieredStore(self.policy, mover=False)
        self.saved: set[str] = set()
        self.sessions: dict[int, list[int]] = {}

    @rule(sid=st.integers(0, 5), grow=st.integers(1, 6))
    def turn(self, sid, grow):
        tokens = self.sessions.setdefault(sid, [sid * 1000])
        tokens.extend(range(len(tokens) + sid * 1000, len(tokens) + sid * 1000 + 16 * grow))
        keys = block_keys(NS, tokens)
        hint = SessionHint(f"s{sid}")
        found = self.store.lookup(keys, hint)
        self.store.mover.tick()  # eviction between lookup and load must spare pinned blocks
        got = check_loaded(self.store, keys[:found.hit_blocks])
        assert MISS not in got, "a block promised by lookup was evicted before its load"
        new = keys[found.hit_blocks:]
        stored = self.store.save(new, frames_for(new), hint)
        self.saved.update(k for k, ok in zip(new, stored) if ok)
        self.store.finish(keys, hint)

    @rule()
    def move(self):
        self.store.mover.drain()
        self.store.mover.tick()

    @rule()
    def lose_pool(self):
        keys = list(self.saved)
        self.store.tiers[0].delete(keys)
        self.store.placement.on_remove(self.store.tiers[0], keys)

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def load_any(self, data):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.saved)), min_size=1, max_size=6,
                                  unique=True))
        check_loaded(self.store, keys)  # asserts: whatever comes back is the saved bytes

    @rule()
    def reopen(self):
        self.store.mover.drain()
        self.store.close()
        self.store = TieredStore(self.policy, mover=False)

    @invariant()
    def within_capacity_and_consistent(self):
        for tier in self.store.tiers:
            assert tier.used_bytes() <= tier.capacity_bytes, tier.name
        ix = self.store.index
        assert ix.pending_count() == 0
        for name in ("nvme", "shared"):
            tier = self.store.by_name[name]
            entries = [e.key for e in ix.scan(name, states=(READY,))]
            assert all(tier.contains(entries)), f"{name}: index entry without bytes"
            assert ix.tier_usage(name)[0] == len(entries)

    def teardown(self):
        self.store.close()


@pytest.fixture
def machine(shared_master, tmp_path):
    TieredMachine.master, TieredMachine.root = shared_master, tmp_path
    return TieredMachine


def run_machine(machine, examples: int) -> None:
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=20, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]))


def test_tiered_state_machine(machine):
    # Each reopen closes the Mooncake client, which takes 1.6 s here: a few examples in the
    # suite, more in the long variant.
    run_machine(machine, 5)


@pytest.mark.slow
def test_tiered_state_machine_long(machine):
    run_machine(machine, 40)


def persisted_within(store, keys, timeout_s: float) -> bool:
    nvme, end = store.by_name["nvme"], time.monotonic() + timeout_s
    while time.monotonic() < end:
        if all(nvme.contains(keys)):
            return True
        time.sleep(0.02)
    return False


def test_the_mover_yields_to_a_prefill_until_it_ends(tmp_path, shared_master):
    keys = block_keys(NS, range(16 * 4))
    with TieredStore(small_policy(tmp_path, shared_master, yield_to_prefill_s=60)) as store:
        store.engine_busy(True)
        store.save(keys, frames_for(keys))
        assert not persisted_within(store, keys, 0.5)  # ten mover intervals: it waits
        assert store.mover.stats["yield_waits"] > 0
        store.engine_busy(False)
        assert persisted_within(store, keys, 10)


class _Decoding:
    """An engine ending a step every 5 ms (decoding) until stopped."""

    def __init__(self, store):
        self.store, self.done = store, threading.Event()
        store.engine_stepped()  # a step has ended before anything is saved
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.005):
            self.store.engine_stepped()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def test_a_persist_waits_while_the_engine_decodes_and_runs_once_it_idles(tmp_path,
                                                                        shared_master):
    keys = block_keys(NS, range(16 * 4))
    with TieredStore(small_policy(tmp_path, shared_master, yield_to_prefill_s=60)) as store:
        engine = _Decoding(store)
        try:
            store.save(keys, frames_for(keys))
            assert not persisted_within(store, keys, 0.5)  # steps every 5 ms: it waits
            assert store.mover.stats["yield_waits"] > 0
        finally:
            engine.stop()
        t0 = time.monotonic()
        assert persisted_within(store, keys, 10)  # idle for `idle_after_s`: it runs
        assert time.monotonic() - t0 < 5


def test_a_persist_waits_for_a_decode_only_so_long(tmp_path, shared_master):
    keys = block_keys(NS, range(16 * 4))
    with TieredStore(small_policy(tmp_path, shared_master, yield_to_prefill_s=0.3)) as store:
        engine = _Decoding(store)  # a decode that never ends
        try:
            t0 = time.monotonic()
            store.save(keys, frames_for(keys))
            assert persisted_within(store, keys, 10)
            assert time.monotonic() - t0 >= 0.3
        finally:
            engine.stop()


def test_a_persist_waits_for_a_prefill_only_so_long(tmp_path, shared_master):
    keys = block_keys(NS, range(16 * 4))
    with TieredStore(small_policy(tmp_path, shared_master, yield_to_prefill_s=0.3)) as store:
        store.engine_busy(True)  # a prefill that never ends
        t0 = time.monotonic()
        store.save(keys, frames_for(keys))
        assert persisted_within(store, keys, 10)
        assert time.monotonic() - t0 >= 0.3
