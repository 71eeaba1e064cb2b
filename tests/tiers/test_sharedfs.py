"""What only the sharedfs tier has: the file layout and modes, several nodes on one directory,
symlinks refused, stale temp files swept, per-node accounting and FIFO eviction, rescans.
The contract itself is test_contract.py."""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import wait_until
from kvtier.store.base import block
from kvtier.store.base.errors import TierError
from kvtier.tiers import MISS
from kvtier.tiers.sharedfs.files import QUARANTINE, block_path
from tier_factories import (KiB, MiB, Spec, check_hit, close, finish_worker, frame_for,
                            keys_for, open_spec, out_for, start_worker)

SIZE = 64 * KiB


@pytest.fixture
def spec(tmp_path) -> Spec:
    return Spec("sharedfs", str(tmp_path))


@pytest.fixture
def tier(spec):
    t = open_spec(spec)
    yield t
    close(t)


def put(tier, keys, size=SIZE):
    return tier.put(keys, [frame_for(k, size) for k in keys])


def get(tier, keys, size=SIZE):
    outs = [out_for(size) for _ in keys]
    return tier.get(keys, outs), outs


def files_under(root: Path, pattern: str = "*") -> list[Path]:
    return [p for p in root.rglob(pattern) if p.is_file() or p.is_symlink()]


def test_one_private_file_per_block_and_no_temp_left(tier):
    keys = keys_for(0, 5)
    put(tier, keys)
    for k in keys:
        p = block_path(tier.root, k)
        assert p.parent.parent.parent == tier.root and p.name == k + ".kvb"
        assert p.parent.name == k[18:20] and p.parent.parent.name == k[16:18]
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert stat.S_IMODE(p.parent.stat().st_mode) == 0o700
        assert p.stat().st_size == block.HEADER_SIZE + SIZE
    assert not files_under(tier.root, "*.tmp")


def test_file_mode_is_exact_whatever_the_umask(spec):
    old = os.umask(0o077)
    try:
        tier = open_spec(replace(spec, extra={"file_mode": 0o640, "fsync": False}))
        k = keys_for(0, 1)
        put(tier, k)
        assert stat.S_IMODE(block_path(tier.root, k[0]).stat().st_mode) == 0o640
        close(tier)
    finally:
        os.umask(old)


def test_nodes_read_each_others_blocks_and_account_only_their_own(spec):
    a = open_spec(spec)
    b = open_spec(replace(spec, node_id="node-b"))
    try:
        keys = keys_for(0, 4)
        put(a, keys)
        res, outs = get(b, keys)
        assert all(check_hit(k, o, r, SIZE) for k, o, r in zip(keys, outs, res))
        assert a.used_bytes() == 4 * (block.HEADER_SIZE + SIZE) and b.used_bytes() == 0
        assert put(b, keys) == [True] * 4 and b.used_bytes() == 0  # already there
        assert b.delete(keys[:1]) == 1  # any node may remove a block
        assert get(a, keys[:1])[0] == [MISS] and a.counters()["corrupt"] == 0
        assert a.used_bytes() == 3 * (block.HEADER_SIZE + SIZE)  # a dropped its entry
    finally:
        close(a)
        close(b)


def test_nodes_in_processes_write_the_same_keys_at_once(spec, tier):
    procs = [start_worker(replace(spec, node_id=f"node-{n}"), "put", start=0, n=30, size=SIZE,
                          batch=5) for n in range(3)]
    assert [finish_worker(p)[-1]["stored"] for p in procs] == [30, 30, 30]
    keys = keys_for(0, 30)
    res, outs = get(tier, keys)
    assert all(check_hit(k, o, r, SIZE) for k, o, r in zip(keys, outs, res))
    assert not files_under(tier.root, "*.tmp")
    assert tier.rescan(prune=False) == (30, 30 * (block.HEADER_SIZE + SIZE))


def test_fanout_directory_removed_by_another_node_is_made_again(tier):
    k = keys_for(0, 2)
    put(tier, k[:1])
    leaf = block_path(tier.root, k[0]).parent
    block_path(tier.root, k[0]).unlink()
    leaf.rmdir()  # a cleanup elsewhere pruned the directory this process knows
    assert put(tier, k[:1]) == [True]
    assert get(tier, k[:1])[0] == [SIZE]


def test_symlink_in_place_of_a_block_is_refused_and_moved_aside(tier, tmp_path):
    k = keys_for(0, 1)[0]
    put(tier, [k])
    target = tmp_path / "elsewhere.kvb"
    target.write_bytes(bytes(frame_for(k, SIZE)[:block.HEADER_SIZE + SIZE]))
    p = block_path(tier.root, k)
    p.unlink()
    p.symlink_to(target)
    assert tier.contains([k]) == [False]
    assert get(tier, [k])[0] == [MISS]
    assert tier.counters()["corrupt"] == 1
    assert not p.is_symlink() and target.exists()
    assert [q.is_symlink() for q in (tier.root / QUARANTINE).iterdir()] == [True]


def test_symlinked_fanout_directory_is_refused(tier, tmp_path):
    k = keys_for(0, 1)[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    block_path(tier.root, k).parent.parent.symlink_to(outside, target_is_directory=True)
    with pytest.raises(TierError, match="symlink"):
        put(tier, [k])
    assert not any(outside.rglob("*"))


def test_trailing_bytes_after_the_frame_are_corruption(tier):
    k = keys_for(0, 1)[0]
    put(tier, [k])
    p = block_path(tier.root, k)
    p.write_bytes(p.read_bytes() + b"junk")
    outs = [out_for(SIZE + 8)]
    assert tier.get([k], outs) == [MISS] and tier.counters()["corrupt"] == 1
    assert len(list((tier.root / QUARANTINE).iterdir())) == 1


def test_stale_temp_files_are_swept_at_open_fresh_ones_kept(spec):
    close(open_spec(spec))
    k = keys_for(0, 1)[0]
    d = block_path(Path(spec.root) / "shared", k).parent
    d.mkdir(parents=True)
    stale, fresh = d / f".{k}.kvb.node-x.1.ab.tmp", d / f".{k}.kvb.node-x.2.cd.tmp"
    for p in (stale, fresh):
        p.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    tier = open_spec(spec)
    try:
        assert tier._sweep.result(timeout=30) == 1
        assert not stale.exists() and fresh.exists()
        assert tier.contains([k]) == [False]  # a temp is never a block
    finally:
        close(tier)


def test_rescan_counts_every_node_and_prunes_vanished_files(spec):
    a = open_spec(spec)
    b = open_spec(replace(spec, node_id="node-b"))
    try:
        put(a, keys_for(0, 3))
        put(b, keys_for(10, 2))
        frame = block.HEADER_SIZE + SIZE
        assert a.rescan() == (5, 5 * frame)
        block_path(a.root, keys_for(0, 1)[0]).unlink()  # removed behind a's back
        assert a.used_bytes() == 3 * frame
        assert a.rescan() == (4, 4 * frame) and a.used_bytes() == 2 * frame
    finally:
        close(a)
        close(b)


def test_full_node_evicts_only_its_own_oldest_files(spec):
    other = open_spec(replace(spec, node_id="node-b"))
    mine = open_spec(replace(spec, capacity="1MiB"))
    try:
        theirs = keys_for(1000, 4)
        put(other, theirs)
        for b in range(0, 40, 4):
            assert put(mine, keys_for(b, 4)) == [True] * 4
        assert mine.used_bytes() <= MiB
        assert other.contains(theirs) == [True] * 4
        assert mine.contains(keys_for(0, 4)) == [False] * 4
        assert mine.contains(keys_for(36, 4)) == [True] * 4
    finally:
        close(mine)
        close(other)


def test_a_filesystem_gone_makes_the_tier_unavailable_not_a_crash(tier, monkeypatch):
    """A network mount whose client or servers went away answers ENOTCONN (seen with a
    GlusterFS host killed): the tier says it is unavailable, in one line with the fix, and
    answers again once the filesystem does. (Mocked: the errno of a dead FUSE mount.)"""
    import errno

    from kvtier.store.base.errors import TierUnavailableError
    from kvtier.tiers.sharedfs import files
    keys = keys_for(900, 2)
    put(tier, keys)
    real = files.is_file

    def not_connected(path):
        raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN), str(path))
    monkeypatch.setattr(files, "is_file", not_connected)
    for call in (lambda: tier.contains(keys), lambda: put(tier, keys_for(910, 1))):
        with pytest.raises(TierUnavailableError, match="not reachable .*check its mount"):
            call()
    monkeypatch.setattr(files, "is_file", real)
    assert tier.contains(keys) == [True, True]


def test_a_hung_mount_costs_a_lookup_its_timeout_once_then_is_skipped_until_it_answers(
        spec, monkeypatch):
    """A `stat` on a hard-mounted network filesystem whose server is gone blocks until the
    server returns. Injected (this host has no network filesystem to cut): the stat hangs.
    The first lookup waits `call_timeout_s` and says why; the lookups after it fail at once
    while the stat hangs; once it returns the tier answers again."""
    from kvtier.store.base.errors import TierUnavailableError
    from kvtier.tiers.sharedfs import files
    t = open_spec(replace(spec, extra={"call_timeout_s": 0.3}))
    try:
        keys = keys_for(0, 3)
        assert put(t, keys) == [True] * 3
        release = threading.Event()
        real = files.is_file

        stats = []

        def hung(path):  # the fault: the filesystem does not answer
            stats.append(path)
            release.wait(30)
            return real(path)

        monkeypatch.setattr(files, "is_file", hung)
        t0 = time.monotonic()
        with pytest.raises(TierUnavailableError, match=r"no answer within 0.3s.*hangs"):
            t.contains(keys)
        assert 0.25 <= time.monotonic() - t0 < 5
        for _ in range(3):
            with pytest.raises(TierUnavailableError, match="waits behind an earlier one"):
                t.contains(keys)
        assert len(stats) == 1  # no stat while the first one hangs
        monkeypatch.setattr(files, "is_file", real)
        release.set()
        wait_until(lambda: not t._lookups.hung(), 10, "the hung stat returned")
        assert t.contains(keys) == [True] * 3
    finally:
        close(t)
