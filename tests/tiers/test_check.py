"""`check()` and `repair()` of the file tiers on real files and a real LMDB index: the open
without recovery, what each kind looks like at tier level, files of other nodes, the races a
check must not report, and the quarantine sweep."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.store.base.config import MasterConfig
from kvtier.store.base.index import Index
from kvtier.store.base.index_record import encode_entry
from kvtier.tiers import TierContext, open_tier
from kvtier.tiers.files import check as check_files
from kvtier.tiers.files.check import Ticker, remove_path
from kvtier.tiers.nvme import check as nvme_check
from kvtier.tiers.sharedfs.check import sweep_quarantine
from kvtier.tiers.sharedfs.files import QUARANTINE, block_path
from tier_factories import FACTORIES, KiB, MiB, Spec, frame_for, keys_for

SIZE = 60 * KiB


class Opened:
    """A tier and its own index (one LMDB handle per process: close before reopening)."""

    def __init__(self, root: Path, factory: str, node: str = "node-a", recover: bool = True,
                 capacity: str = "64MiB"):
        spec = Spec(factory, str(root), node_id=node, capacity=capacity)
        self.index = Index(spec.index_path, map_size_bytes=64 * MiB, recover=False)
        ctx = TierContext(self.index, node, MasterConfig(), recover=recover)
        self.tier = open_tier(FACTORIES[factory].make_config(spec), ctx)

    def put(self, keys):
        assert self.tier.put(keys, [frame_for(k, SIZE) for k in keys]) == [True] * len(keys)

    def close(self):
        self.tier.close()
        self.index.close()


def kinds(problems) -> set:
    return {(p.kind, p.key) for p in problems}


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("factory", ["nvme-psync", "sharedfs"])
def test_open_without_recovery_keeps_the_leftovers_a_check_reports(tmp_path, factory):
    t = Opened(tmp_path, factory)
    keys = keys_for(0, 3)
    t.put(keys[:2])
    assert t.index.reserve([t.index.get(t.tier.name, [keys[0]])[0].replace(key=keys[2])])
    e = t.index.get(t.tier.name, [keys[2]], ready_only=False)[0]
    with t.index._txn(write=True) as txn:  # the writer that reserved it has died since
        txn.put(t.index._k(keys[2], t.tier.name),
                encode_entry(e.replace(owner_pid=dead_pid())), db=t.index._db("blocks"))
    temp = block_path(tmp_path / "shared", keys[0]).parent / f".{keys[0]}.kvb.node-z.1.ab.tmp"
    if factory == "sharedfs":
        temp.write_bytes(b"x")
        os.utime(temp, (time.time() - 7200,) * 2)
    t.close()

    t = Opened(tmp_path, factory, recover=False)
    assert t.index.pending_count() == 1  # the node check reports it (`pending`)
    stale = {("stale_temp", keys[0])} if factory == "sharedfs" else set()
    assert kinds(t.tier.check()) == stale
    time.sleep(0.2)  # no sweep runs in the background either
    assert factory != "sharedfs" or temp.exists()
    t.close()
    t = Opened(tmp_path, factory, recover=True)  # what every instance does at open
    if factory == "sharedfs":
        t.tier._sweep.result(timeout=10)
    assert t.index.pending_count() == 0 and not temp.exists()
    t.close()


def test_nvme_region_reclaimed_under_the_check_is_not_a_problem(tmp_path):
    t = Opened(tmp_path, "nvme-psync", capacity="1MiB")  # 4 regions of 256 KiB
    old = keys_for(0, 12)
    t.put(old)
    snap = nvme_check.snapshot(t.tier)
    assert len(snap.entries) == 12
    for start in range(100, 160, 4):  # reclaims and rewrites every region, old entries drop
        t.put(keys_for(start, 4))
    fd = os.open(t.tier.path / "regions.kvr", os.O_RDONLY)
    raw = [memoryview(bytearray(os.pread(fd, 64 * KiB, t.tier.regions.offset(e))))
           for e in snap.entries]
    os.close(fd)
    # The snapshot's frames are gone for real: a check that trusted it would report them...
    assert all(nvme_check.frame_problem(t.tier, e, b, len(b)) is not None
               for e, b in zip(snap.entries, raw))
    # ...but it looks again before reporting, and nothing changed that a reader would trust.
    assert nvme_check._check_entries(t.tier, snap, Ticker(None, 0)) == []
    assert t.tier.check() == []
    t.close()


def test_nvme_truncated_or_missing_data_file_and_lost_frames(tmp_path, monkeypatch):
    monkeypatch.setattr(check_files, "PAGE_ENTRIES", 3)  # many snapshot pages
    t = Opened(tmp_path, "nvme-psync", capacity="2MiB")  # 4 regions of 512 KiB
    keys = keys_for(0, 14)
    t.put(keys)
    data = t.tier.path / "regions.kvr"
    region_of = {k: t.tier.regions.offset(t.index.get("nvme", [k])[0]) // (512 * KiB)
                 for k in keys}
    zeroed = keys[1]
    fd = os.open(data, os.O_WRONLY)
    os.pwrite(fd, bytes(4096), t.tier.regions.offset(t.index.get("nvme", [zeroed])[0]))
    os.fsync(fd)
    os.close(fd)
    t.close()
    os.truncate(data, 512 * KiB)  # only region 0 is left

    t = Opened(tmp_path, "nvme-psync", capacity="2MiB", recover=False)
    want = {("missing", k) for k in keys if region_of[k] > 0} | {("missing", zeroed)}
    calls = []
    problems = t.tier.check(lambda done, total: calls.append((done, total)))
    assert kinds(problems) == want and len(want) > 2
    assert calls[0] == (0, 14) and calls[-1] == (14, 14)
    assert any("never written" in p.detail for p in problems if p.key == zeroed)
    assert os.path.getsize(data) == 512 * KiB  # the check neither resized...
    t.close()
    data.unlink()
    t = Opened(tmp_path, "nvme-psync", capacity="2MiB", recover=False)
    assert kinds(t.tier.check()) == {("missing", k) for k in keys}
    assert not data.exists()  # ...nor made the data file
    assert t.tier.repair(t.tier.check()) == len(keys)
    assert t.tier.check() == [] and t.index.tier_usage("nvme") == (0, 0)
    t.close()


def test_sharedfs_files_of_other_nodes(tmp_path):
    b = Opened(tmp_path, "sharedfs", node="node-b")
    theirs = keys_for(0, 4)
    b.put(theirs)
    b.close()
    a = Opened(tmp_path, "sharedfs", node="node-a", recover=False)
    assert a.tier.check() == []  # sound files of another node are blocks, not orphans
    bad = block_path(a.tier.root, theirs[0])
    data = bytearray(bad.read_bytes())
    data[200] ^= 1
    bad.write_bytes(bytes(data))
    misplaced = block_path(a.tier.root, theirs[1]).parent / f"{keys_for(9, 1)[0]}.kvb"
    misplaced.write_bytes(bad.read_bytes())
    leaf = block_path(a.tier.root, theirs[2]).parent
    live = leaf / f".{theirs[2]}.kvb.{a.tier.node}.{os.getpid()}.ab.tmp"
    other = leaf / f".{theirs[2]}.kvb.node-b.{dead_pid()}.cd.tmp"  # not ours to judge
    dead = leaf / f".{theirs[3]}.kvb.{a.tier.node}.{dead_pid()}.ef.tmp"
    for p in (live, other, dead):
        p.write_bytes(b"partial")
    problems = a.tier.check()
    assert kinds(problems) == {("corrupt", theirs[0]), ("orphan", keys_for(9, 1)[0]),
                               ("stale_temp", theirs[3])}
    assert a.tier.repair(problems) == 3
    assert a.tier.check() == []
    assert not bad.exists() and len(list((a.tier.root / QUARANTINE).iterdir())) == 1
    assert live.exists() and other.exists() and not dead.exists()
    a.close()


def test_sharedfs_files_another_node_evicted_are_notices(tmp_path):
    """Any node may evict any file of the shared tier, and this node's entry of it stays
    until a read or a rescan meets the gap: `gone`, a notice, not a problem (a check beside
    other nodes reported these as `missing` and failed). Something other than a regular
    file at the path is still `missing`."""
    keys = keys_for(0, 4)
    a = Opened(tmp_path, "sharedfs", node="node-a")
    a.put(keys)
    a.close()
    b = Opened(tmp_path, "sharedfs", node="node-b")
    assert b.tier.delete(keys[:2]) == 2  # b evicts blocks both nodes hold
    b.close()
    a = Opened(tmp_path, "sharedfs", node="node-a", recover=False)
    link = block_path(a.tier.root, keys[3])
    link.unlink()
    link.symlink_to("/etc/hostname")
    problems = a.tier.check()
    assert {(p.kind, p.key) for p in problems if p.kind != "orphan"} == \
        {("gone", keys[0]), ("gone", keys[1]), ("missing", keys[3])}
    assert a.tier.repair(problems) >= 3
    assert a.tier.check() == []
    assert [e is not None for e in a.index.get(a.tier.name, keys)] == [False, False, True, False]
    a.close()


def test_quarantine_sweep_by_the_time_frames_were_set_aside(tmp_path):
    q = tmp_path / QUARANTINE
    q.mkdir()
    key = keys_for(0, 1)[0]
    old = q / f"{key}.n.{int((time.time() - 3 * 86400) * 1e9)}.kvb"
    new = q / f"{key}.n.{time.time_ns()}.kvb"
    unnamed = q / "something"  # no time in its name: its ctime (now) counts
    for p in (old, new, unnamed):
        p.write_bytes(b"x")
        os.utime(p, (0, 0))  # mtime is the write's, never the quarantine's
    assert sweep_quarantine(tmp_path, 86400, dry_run=True) == 1 and old.exists()
    assert sweep_quarantine(tmp_path, 86400) == 1
    assert not old.exists() and new.exists() and unnamed.exists()


def test_remove_path_never_follows_a_link_and_stays_inside_the_root(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text(socket.gethostname())
    root = tmp_path / "root"
    root.mkdir()
    (root / "ab").symlink_to(outside)
    assert remove_path(root / "ab", root) and (outside / "precious").exists()
    with pytest.raises(ValueError, match="not inside the tier root"):
        remove_path(outside, root)
