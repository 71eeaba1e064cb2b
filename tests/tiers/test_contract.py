"""The tier contract (`tiers/base.py`), once per tier in `tier_factories.FACTORIES`.

Round trips of 1 KiB to 16 MiB frames (aligned and not), batches mixing hits and misses,
duplicates, deletes, a full tier, a restart, threads and processes at once, and corruption of
every kind. Tier-specific behaviour lives in test_<tier>.py.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from kvtier.store.base import block
from kvtier.store.base.errors import TierError, TierFullError
from kvtier.tiers import MISS
from tier_factories import (FACTORIES, KiB, MiB, OTHER_NS, Spec, check_hit, close,
                            finish_worker, frame_for, keys_for, open_spec, out_for,
                            payload_for, start_worker)


@pytest.fixture(params=sorted(FACTORIES))
def spec(request, tmp_path) -> Spec:
    factory = FACTORIES[request.param]
    extra = factory.extra_for(request) if factory.extra_for else None
    return Spec(request.param, str(tmp_path), extra=extra)


@pytest.fixture
def tier(spec):
    t = open_spec(spec)
    yield t
    close(t)


def put_keys(tier, keys, size, aligned=True) -> list[bool]:
    return tier.put(keys, [frame_for(k, size, aligned) for k in keys])


def get_keys(tier, keys, size, aligned=True) -> tuple[list[int], list[memoryview]]:
    outs = [out_for(size, aligned) for _ in keys]
    return tier.get(keys, outs), outs


SIZES = {"1KiB": KiB, "page-64": 4 * KiB - 64, "64KiB+7": 64 * KiB + 7, "1MiB": MiB,
         "2MiB": 2 * MiB, "16MiB": 16 * MiB}


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
def test_round_trip_aligned_and_unaligned_buffers(tier, size):
    keys = keys_for(0, 2)
    frames = [frame_for(keys[0], size), frame_for(keys[1], size, aligned=False)]
    assert tier.put(keys, frames) == [True, True]
    assert tier.contains(keys) == [True, True]
    for aligned in (True, False):
        res, outs = get_keys(tier, keys, size, aligned)
        assert res == [size, size]
        assert all(check_hit(k, o, r, size) for k, o, r in zip(keys, outs, res))
        # The whole frame lands at out[0:64+n], header included.
        assert bytes(outs[0][:block.HEADER_SIZE + size]) == \
            bytes(frames[0][:block.HEADER_SIZE + size])


def test_batch_mixes_hits_and_misses(tier):
    stored, absent = keys_for(0, 12), keys_for(100, 6)
    assert put_keys(tier, stored, 8 * KiB) == [True] * 12
    order = [k for pair in zip(stored[:6], absent) for k in pair] + stored[6:]
    res, outs = get_keys(tier, order, 8 * KiB)
    for k, r, o in zip(order, res, outs):
        assert (r == MISS) if k in absent else check_hit(k, o, r, 8 * KiB)
    assert tier.contains(order) == [k in stored for k in order]
    c = tier.counters()
    assert (c["hits"], c["misses"], c["corrupt"]) == (12, 6, 0)
    assert c["puts"] == 12 and c["bytes_in"] >= 12 * 8 * KiB


def test_put_again_and_duplicates_in_one_batch_store_once(tier):
    before = tier.used_bytes()
    k = keys_for(0, 2)
    assert put_keys(tier, [k[0], k[0], k[1]], 16 * KiB) == [True, True, True]
    assert put_keys(tier, k, 16 * KiB) == [True, True]
    frame_bytes = 2 * (block.HEADER_SIZE + 16 * KiB)
    assert frame_bytes <= tier.used_bytes() - before <= 2 * frame_bytes
    assert tier.counters()["puts"] == 2


def test_frame_sealed_for_another_key_is_refused(tier):
    k = keys_for(0, 2)
    with pytest.raises(ValueError):
        tier.put([k[0]], [frame_for(k[1], KiB)])
    assert tier.contains([k[0]]) == [False]


def test_delete_then_miss_then_put_again(tier):
    before = tier.used_bytes()
    keys = keys_for(0, 4)
    put_keys(tier, keys, 32 * KiB)
    assert tier.delete([keys[0], keys[1], keys_for(50, 1)[0]]) == 2
    assert tier.contains(keys) == [False, False, True, True]
    res, _ = get_keys(tier, keys, 32 * KiB)
    assert res[:2] == [MISS, MISS] and res[2:] == [32 * KiB] * 2
    assert tier.delete(keys) == 2
    assert tier.used_bytes() == before
    assert put_keys(tier, keys[:1], 32 * KiB) == [True]
    res, outs = get_keys(tier, keys[:1], 32 * KiB)
    assert check_hit(keys[0], outs[0], res[0], 32 * KiB)


def test_full_tier_reclaims_its_oldest_blocks(spec):
    factory = FACTORIES[spec.factory]
    tier = open_spec(replace(spec, capacity="8MiB"))
    try:
        size, n = 200 * KiB, 120  # three times the capacity
        if not factory.reclaims_when_full:
            with pytest.raises(TierFullError) as err:
                for b in range(0, n, 8):
                    put_keys(tier, keys_for(b, 8), size)
            assert all(tier.contains(err.value.stored))
            return
        for b in range(0, n, 8):
            assert put_keys(tier, keys_for(b, 8), size) == [True] * 8
        assert 0 < tier.used_bytes() <= tier.capacity_bytes
        newest, oldest = keys_for(n - 8, 8), keys_for(0, 8)
        res, outs = get_keys(tier, newest + oldest, size)
        assert all(check_hit(k, o, r, size) for k, o, r in zip(newest, outs, res))
        assert res[8:] == [MISS] * 8
        assert tier.counters()["corrupt"] == 0
    finally:
        close(tier)


def test_blocks_survive_a_restart(spec):
    if not FACTORIES[spec.factory].outlives_writer:
        pytest.skip("a closed client takes its segment, and the blocks in it, along")
    keys = keys_for(0, 6)
    tier = open_spec(spec)
    put_keys(tier, keys, 100 * KiB)
    used = tier.used_bytes()
    close(tier)
    tier = open_spec(spec)
    try:
        assert tier.contains(keys) == [True] * 6
        res, outs = get_keys(tier, keys, 100 * KiB)
        assert all(check_hit(k, o, r, 100 * KiB) for k, o, r in zip(keys, outs, res))
        assert tier.used_bytes() == used
    finally:
        close(tier)


def test_threads_read_and_write_at_once(tier):
    size, per = 64 * KiB, 20
    wrong, errors = [], []

    def worker(t: int) -> None:
        try:
            mine = keys_for(t * per, per)
            for b in range(0, per, 4):
                assert put_keys(tier, mine[b:b + 4], size) == [True] * 4
                probe = keys_for(((t + 1) % 4) * per + b, 4) + mine[:b + 4]
                res, outs = get_keys(tier, probe, size, aligned=bool(b % 8))
                wrong.extend(k for k, o, r in zip(probe, outs, res)
                             if r != MISS and not check_hit(k, o, r, size))
        except BaseException as e:  # surfaced by the assertion below, with the cause
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert not wrong
    keys = keys_for(0, 4 * per)
    res, outs = get_keys(tier, keys, size)
    assert all(check_hit(k, o, r, size) for k, o, r in zip(keys, outs, res))


def test_processes_write_while_this_one_reads(spec, tier):
    size = 48 * KiB
    procs = [start_worker(spec, "put", start=p * 40, n=40, size=size) for p in range(2)]
    wrong = 0
    while any(p.poll() is None for p in procs):
        keys = keys_for(0, 80)
        res, outs = get_keys(tier, keys, size)
        wrong += sum(1 for k, o, r in zip(keys, outs, res)
                     if r != MISS and not check_hit(k, o, r, size))
    assert [finish_worker(p)[-1]["stored"] for p in procs] == [40, 40]
    assert wrong == 0
    if not FACTORIES[spec.factory].outlives_writer:
        return  # the writers exited and took their segments, and blocks, along
    keys = keys_for(0, 80)
    res, outs = get_keys(tier, keys, size)
    assert all(check_hit(k, o, r, size) for k, o, r in zip(keys, outs, res))


def test_reclaim_races_between_processes_are_misses_never_corruption(spec):
    # Two processes: a shared pool gets what two pools of 8 MiB (16 MiB, Mooncake's least
    # segment) would hold between them.
    shared = FACTORIES[spec.factory].shared_by_processes
    small = replace(spec, capacity="32MiB" if shared else "8MiB")
    procs = [start_worker(small, "churn", keys=64, size=256 * KiB, seconds=3.0, seed=s)
             for s in range(2)]
    results = [finish_worker(p)[-1] for p in procs]
    for r in results:
        assert r["wrong"] == 0 and r["corrupt"] == 0, r
        assert r["hits"] > 0 and r["puts"] > 0, r


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x10
    return bytes(b)


def _reseal(key: str, data: bytes) -> bytes:
    n = len(data) - block.HEADER_SIZE
    return bytes(block.encode(key, payload_for(key, n)))


CORRUPTIONS = {
    "payload-bitflip": lambda key, d: _flip(d, block.HEADER_SIZE + len(d) // 2),
    "header-bitflip": lambda key, d: _flip(d, 20),
    "truncated": lambda key, d: d[:len(d) // 2],
    "header-only": lambda key, d: d[:block.HEADER_SIZE],
    "bad-magic": lambda key, d: b"XXXX" + d[4:],
    "zeroed": lambda key, d: bytes(len(d)),
    "wrong-namespace": lambda key, d: _reseal(OTHER_NS + key[16:], d),
    "wrong-key": lambda key, d: _reseal(keys_for(999, 1)[0], d),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_block_is_counted_dropped_and_missed(spec, tier, kind):
    factory, size = FACTORIES[spec.factory], 64 * KiB
    keys = keys_for(0, 2)
    put_keys(tier, keys, size)
    stored = factory.raw_read(tier, keys[0])
    assert stored[:block.HEADER_SIZE] == bytes(frame_for(keys[0], size)[:block.HEADER_SIZE])
    factory.raw_write(tier, keys[0], CORRUPTIONS[kind](keys[0], stored))
    res, outs = get_keys(tier, keys, size)
    assert res[0] == MISS and check_hit(keys[1], outs[1], res[1], size)
    assert tier.counters()["corrupt"] == 1
    assert tier.contains(keys) == [False, True]  # quarantined: no longer offered
    assert get_keys(tier, keys[:1], size)[0] == [MISS]
    assert tier.counters()["corrupt"] == 1  # counted once: the bad copy is gone
    assert put_keys(tier, keys[:1], size) == [True]
    res, outs = get_keys(tier, keys[:1], size)
    assert check_hit(keys[0], outs[0], res[0], size)


def test_closed_tier_refuses_calls_and_closes_twice(spec):
    tier = open_spec(spec)
    close(tier)
    with pytest.raises(TierError):
        tier.contains(keys_for(0, 1))
    tier.close()
