"""What only the nvme tier has: regions and their FIFO reclaim, generations, recovery of dead
writers, layout changes, and the two I/O engines. The contract itself is test_contract.py."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from kvtier.store.base import block
from kvtier.store.base.errors import ConfigError
from kvtier.store.base.index_record import Entry
from kvtier.tiers import MISS
from kvtier.tiers.files.buffers import BouncePool
from kvtier.tiers.nvme import regions
from kvtier.tiers.nvme.io_engines import IOOp, make_engine
from kvtier.tiers.nvme.regions import pack_loc, unpack_loc
from tier_factories import (KiB, MiB, Spec, check_hit, close, frame_for, keys_for, open_spec,
                            out_for)

PAYLOAD = 256 * KiB - block.HEADER_SIZE  # one 256 KiB slot: four per 1 MiB region


@pytest.fixture(params=["nvme-uring", "nvme-psync"])
def spec(request, tmp_path) -> Spec:
    return Spec(request.param, str(tmp_path), capacity="4MiB", extra={"region_size": "1MiB"})


def put(tier, keys, size=PAYLOAD):
    return tier.put(keys, [frame_for(k, size) for k in keys])


def get(tier, keys, size=PAYLOAD):
    outs = [out_for(size) for _ in keys]
    return tier.get(keys, outs), outs


def test_full_regions_are_reclaimed_oldest_first(spec):
    tier = open_spec(spec)
    try:
        assert put(tier, keys_for(0, 16)) == [True] * 16  # four regions, full
        assert (tier.path / "regions.kvr").stat().st_size == 4 * MiB
        assert put(tier, keys_for(16, 4)) == [True] * 4  # reclaims the first region only
        res, outs = get(tier, keys_for(0, 20))
        assert res[:4] == [MISS] * 4
        assert all(check_hit(k, o, r, PAYLOAD)
                   for k, o, r in zip(keys_for(4, 16), outs[4:], res[4:]))
        assert tier.counters()["corrupt"] == 0
        assert tier.used_bytes() == 16 * (PAYLOAD + block.HEADER_SIZE)
        assert tier.test_index.tier_usage("nvme")[0] == 16
    finally:
        close(tier)


def test_entry_of_a_reclaimed_generation_is_a_plain_miss(spec):
    tier = open_spec(spec)
    try:
        k = keys_for(0, 1)[0]
        put(tier, [k])
        old = tier.test_index.get("nvme", [k])[0]
        put(tier, keys_for(1, 16))  # wraps around: k's region is reclaimed and rewritten
        assert tier.contains([k]) == [False]
        # An index entry that still names the old generation (as a reader that looked it up
        # before the reclaim holds it) must never be served.
        tier.test_index.reserve([old])
        tier.test_index.commit("nvme", [k])
        assert tier.contains([k]) == [False]
        assert get(tier, [k])[0] == [MISS]
        assert tier.counters()["corrupt"] == 0
    finally:
        close(tier)


def test_location_holding_another_block_is_corrupt_and_dropped(spec):
    tier = open_spec(spec)
    try:
        a, c = keys_for(0, 2)
        put(tier, [a])
        loc = tier.test_index.get("nvme", [a])[0]
        # c's entry points at a's bytes in a live generation: the header names another key.
        tier.test_index.reserve([Entry(c, "nvme", size=loc.size, checksum=loc.checksum,
                                       loc_a=loc.loc_a, loc_b=loc.loc_b)])
        tier.test_index.commit("nvme", [c])
        res, outs = get(tier, [c, a])
        assert res[0] == MISS and check_hit(a, outs[1], res[1], PAYLOAD)
        assert tier.counters()["corrupt"] == 1
        assert tier.test_index.get("nvme", [c], ready_only=False) == [None]
    finally:
        close(tier)


_DEAD_WRITER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from tier_factories import Spec, open_spec, keys_for, frame_for
    from kvtier.store.base.index_record import Entry
    from kvtier.tiers.nvme.regions import pack_loc
    tier = open_spec(Spec(sys.argv[2], sys.argv[3], capacity="4MiB",
                          extra={"region_size": "1MiB"}))
    tier.put(keys_for(100, 2), [frame_for(k, 1000) for k in keys_for(100, 2)])
    # Reserve a block and die before writing it: a PENDING entry and an open region remain.
    key = keys_for(200, 1)[0]
    alloc = tier.regions.allocate([4096], [key])
    slot, gen, off = alloc.locs[0]
    tier.test_index.reserve([Entry(key, "nvme", size=1064, loc_a=pack_loc(slot, gen),
                                   loc_b=off)])
    print(slot, off + 4096, flush=True)
    os._exit(0)
""")


def test_dead_writer_leaves_no_pending_entry_and_its_region_is_adopted(spec):
    out = subprocess.run([sys.executable, "-c", _DEAD_WRITER, os.path.dirname(__file__),
                          spec.factory, spec.root], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    slot, end = map(int, out.stdout.split())
    tier = open_spec(spec)
    try:
        assert tier.test_index.pending_count() == 0
        assert tier.contains(keys_for(100, 2) + keys_for(200, 1)) == [True, True, False]
        k = keys_for(300, 1)[0]
        put(tier, [k])
        e = tier.test_index.get("nvme", [k])[0]
        assert (unpack_loc(e.loc_a)[0], e.loc_b) == (slot, end)  # appended after the dead one
        for b in range(0, 40, 4):  # two and a half times around: nothing is stuck
            assert put(tier, keys_for(400 + b, 4)) == [True] * 4
        assert tier.used_bytes() <= tier.capacity_bytes
    finally:
        close(tier)


def test_running_writer_adopts_the_region_of_a_writer_that_died_later(spec, monkeypatch):
    tier = open_spec(spec)  # open before the other writer starts, so no recovery at open
    try:
        put(tier, keys_for(0, 1))
        out = subprocess.run([sys.executable, "-c", _DEAD_WRITER, os.path.dirname(__file__),
                              spec.factory, spec.root], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        slot, end = map(int, out.stdout.split())
        monkeypatch.setattr(regions, "ORPHAN_SCAN_S", 0.0)
        put(tier, keys_for(1, 4))  # the fourth needs a region: the dead writer's is adopted
        e = tier.test_index.get("nvme", keys_for(4, 1))[0]
        assert (unpack_loc(e.loc_a)[0], e.loc_b) == (slot, end)
    finally:
        close(tier)


def test_adopted_region_too_full_for_the_next_frame_is_sealed_not_overrun(spec):
    first = open_spec(spec)
    put(first, keys_for(0, 3))  # 768 KiB of a 1 MiB region, then parked at close
    close(first)
    tier = open_spec(spec)
    try:
        k = keys_for(10, 1)
        assert put(tier, k, size=2 * PAYLOAD + block.HEADER_SIZE) == [True]  # 512 KiB slot
        e = tier.test_index.get("nvme", k)[0]
        assert e.loc_b + 512 * KiB <= MiB  # never across a region boundary
        assert put(tier, keys_for(20, 3)) == [True] * 3  # fills the regions around it
        res, outs = get(tier, keys_for(0, 3) + k, size=2 * PAYLOAD + block.HEADER_SIZE)
        assert check_hit(k[0], outs[3], res[3], 2 * PAYLOAD + block.HEADER_SIZE)
    finally:
        close(tier)


def test_region_with_a_write_in_flight_is_skipped_by_reclaim(spec):
    tier = open_spec(spec)
    try:
        x = keys_for(999, 1)[0]
        alloc = tier.regions.allocate([4096], [x])  # as put does, before it writes
        slot, gen, off = alloc.locs[0]
        assert tier.test_index.reserve([Entry(x, "nvme", size=1000, loc_a=pack_loc(slot, gen),
                                              loc_b=off)]) == [True]
        put(tier, keys_for(0, 15))  # x's region first (3 more fit), then three more regions
        put(tier, keys_for(15, 4))  # needs a reclaim: x's region is the oldest, but busy
        assert tier.test_index.get("nvme", [x], ready_only=False)[0].loc_a == pack_loc(slot, gen)
        assert tier.contains(keys_for(0, 3)) == [True] * 3  # x's neighbours survived
        assert tier.contains(keys_for(3, 4)) == [False] * 4  # the next oldest went instead
        tier.test_index.abort("nvme", [x])
    finally:
        close(tier)


def test_changed_region_size_is_a_clear_error(spec):
    close(open_spec(spec))
    with pytest.raises(ConfigError, match="region_size"):
        open_spec(replace(spec, extra={"region_size": "2MiB"}))


def test_capacity_shrink_retires_regions_and_growth_reuses_them(spec):
    big = replace(spec, capacity="8MiB")
    tier = open_spec(big)
    put(tier, keys_for(0, 32))
    close(tier)
    tier = open_spec(spec)  # 4 regions instead of 8
    try:
        present = tier.contains(keys_for(0, 32))
        assert present == [True] * 16 + [False] * 16
        assert tier.used_bytes() == 16 * (PAYLOAD + block.HEADER_SIZE)
        assert put(tier, keys_for(100, 8)) == [True] * 8
        assert tier.used_bytes() <= tier.capacity_bytes
    finally:
        close(tier)
    tier = open_spec(big)
    try:
        assert put(tier, keys_for(200, 24)) == [True] * 24
        assert tier.used_bytes() <= tier.capacity_bytes
    finally:
        close(tier)


def test_frame_larger_than_a_region_is_refused(spec):
    tier = open_spec(spec)
    try:
        with pytest.raises(ValueError, match="region_size"):
            put(tier, keys_for(0, 1), size=MiB)
    finally:
        close(tier)


def test_unbuffered_io_direct_false_round_trips(spec):
    tier = open_spec(replace(spec, extra={"region_size": "1MiB", "io": {"direct": False}}))
    try:
        keys = keys_for(0, 3)
        put(tier, keys, size=5000)
        res, outs = get(tier, keys, size=5000)
        assert all(check_hit(k, o, r, 5000) for k, o, r in zip(keys, outs, res))
    finally:
        close(tier)


@pytest.fixture
def direct_file(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.ftruncate(fd, 4 * MiB)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("name", ["uring", "psync"])
def test_engine_moves_bytes_and_reports_errno(name, direct_file):
    engine = make_engine(name, 8)
    try:
        bufs = [memoryview(mmap.mmap(-1, 64 * KiB)) for _ in range(20)]
        for i, b in enumerate(bufs):
            b[:] = bytes([i]) * len(b)
        assert engine.run([IOOp(direct_file, b, i * 64 * KiB, True)
                           for i, b in enumerate(bufs)]) == [64 * KiB] * 20
        back = [memoryview(mmap.mmap(-1, 64 * KiB)) for _ in range(20)]
        assert engine.run([IOOp(direct_file, b, i * 64 * KiB, False)
                           for i, b in enumerate(back)]) == [64 * KiB] * 20
        assert all(bytes(b) == bytes([i]) * 64 * KiB for i, b in enumerate(back))
        odd = memoryview(bytearray(8 * KiB + 1))[1:]  # not page-aligned: O_DIRECT refuses
        res = engine.run([IOOp(direct_file, odd, 0, False), IOOp(-1, back[0], 0, False)])
        assert res == [-errno.EINVAL, -errno.EBADF]
    finally:
        engine.close()


def test_uring_engine_does_not_pin_caller_buffers(direct_file):
    engine = make_engine("uring", 4)
    try:
        m = mmap.mmap(-1, 64 * KiB)
        view = memoryview(m)
        assert engine.run([IOOp(direct_file, view[:32 * KiB], 0, True)]) == [32 * KiB]
        view.release()
        m.close()  # raises BufferError if the bindings still held an export of it
    finally:
        engine.close()


def test_missing_liburing_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "liburing", None)
    with pytest.raises(ConfigError, match="pip install liburing"):
        make_engine("uring", 8)


def test_bounce_buffers_are_never_shared_with_a_forked_child():
    pool = BouncePool()
    buf = pool.take(64 * KiB)
    buf[:4] = b"mine"
    pool.give(buf)
    pid = os.fork()
    if pid == 0:  # the child scribbles on whatever its pool hands out, then leaves
        child = pool.take(64 * KiB)
        child[:4] = b"kids"
        buf[:4] = b"kids"  # even the inherited view is a private copy now
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    again = pool.take(64 * KiB)
    assert again is buf and bytes(again[:4]) == b"mine"


def test_uring_runs_io_uring_where_the_bindings_work_here():
    from kvtier.tiers.nvme import uring
    why = uring.crash_reason()
    if why is not None:
        pytest.skip(f"the installed liburing bindings cannot run on this machine: {why}")
    engine = make_engine("uring", 8)
    try:
        assert isinstance(engine, uring.UringEngine)
    finally:
        engine.close()


def test_bindings_that_would_kill_the_process_fall_back_to_psync(monkeypatch, caplog):
    from kvtier.tiers.nvme import io_engines, uring
    # A child that really dies of SIGILL, as one running a build for another CPU does.
    monkeypatch.setattr(uring, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    uring.crash_reason.cache_clear()
    uring._warn_once.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            engine = make_engine("uring", 8)
        assert isinstance(engine, io_engines.PsyncEngine)
        assert "SIGILL" in caplog.text and "io.engine: psync" in caplog.text
        assert uring.crash_reason() is not None  # probed once per process, then remembered
    finally:
        uring.crash_reason.cache_clear()
        uring._warn_once.cache_clear()
