"""Faults of the file tiers (nvme with both engines, sharedfs), caused for real: a missing or
read-only tier path, a disk that fills up (a small tmpfs mount), a writer killed by SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.store.base.config import MasterConfig
from kvtier.store.base.errors import TierFullError, TierUnavailableError
from kvtier.store.base.index import Index
from kvtier.tiers import MISS, TierContext, open_tier
from tier_factories import (FACTORIES, KiB, MiB, Spec, check_hit, close, frame_for, keys_for,
                            open_spec, out_for, start_worker)

FILE_TIERS = ["nvme-uring", "nvme-psync", "sharedfs"]


@pytest.fixture(params=FILE_TIERS)
def factory_id(request) -> str:
    return request.param


@pytest.fixture
def mount(tmp_path):
    """mount(name, size, ro=False) -> a fresh tmpfs directory, unmounted after the test."""
    mounted: list[Path] = []

    def make(name: str, size: str = "8m", ro: bool = False) -> Path:
        where = tmp_path / name
        where.mkdir()
        opts = f"size={size},mode=0700" + (",ro" if ro else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root")
        mounted.append(where)
        return where

    yield make
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False)


def open_at(factory_id: str, root: Path, index_dir: Path, **spec_kw):
    """Open a tier whose files live under `root` and whose index lives elsewhere."""
    spec = Spec(factory_id, str(root), **spec_kw)
    cfg = FACTORIES[factory_id].make_config(spec)
    index = Index(index_dir, map_size_bytes=64 * MiB)
    try:
        tier = open_tier(cfg, TierContext(index, "node-a", MasterConfig()))
    except BaseException:
        index.close()
        raise
    tier.test_index = index
    return tier


def test_missing_path_is_a_clear_error_at_start(factory_id, tmp_path):
    with pytest.raises(TierUnavailableError) as err:
        open_at(factory_id, tmp_path / "not-mounted", tmp_path / "index")
    msg = str(err.value)
    assert str(tmp_path / "not-mounted") in msg and "mount" in msg and "\n" not in msg


def test_missing_leaf_under_an_existing_parent_is_created(factory_id, tmp_path):
    tier = open_at(factory_id, tmp_path, tmp_path / "index")
    try:
        k = keys_for(0, 1)
        assert tier.put(k, [frame_for(k[0], KiB)]) == [True]
    finally:
        close(tier)


def test_read_only_path_is_a_clear_error_at_start(factory_id, tmp_path, mount):
    ro = mount("ro", ro=True)
    with pytest.raises(TierUnavailableError, match="read-only") as err:
        open_at(factory_id, ro, tmp_path / "index")
    assert str(ro) in str(err.value)
    rw = mount("rw")  # a tier directory that exists, then goes read-only under us
    close(open_at(factory_id, rw, tmp_path / "index2"))
    subprocess.run(["mount", "-o", "remount,ro", str(rw)], check=True)
    with pytest.raises(TierUnavailableError, match="read-only"):
        open_at(factory_id, rw, tmp_path / "index2")


def test_disk_full_raises_tier_full_with_no_torn_block(factory_id, tmp_path, mount):
    disk = mount("small", size="8m")
    tier = open_at(factory_id, disk, tmp_path / "index", capacity="64MiB",
                   extra={"region_size": "4MiB"} if factory_id.startswith("nvme") else None)
    size, stored = 512 * KiB, []
    try:
        with pytest.raises(TierFullError) as err:
            for b in range(0, 200, 4):
                keys = keys_for(b, 4)
                assert tier.put(keys, [frame_for(k, size) for k in keys]) == [True] * 4
                stored += keys
        assert "ENOSPC" in str(err.value), err.value
        failed = [k for k in keys if k not in err.value.stored]
        assert failed and set(err.value.stored) <= set(keys)
        stored += err.value.stored
        assert tier.test_index.pending_count() == 0
        assert tier.contains(failed) == [False] * len(failed)
        outs = [out_for(size) for _ in stored + failed]
        res = tier.get(stored + failed, outs)  # the tier keeps serving reads
        assert all(check_hit(k, o, r, size) for k, o, r in zip(stored, outs, res))
        assert res[len(stored):] == [MISS] * len(failed)
        assert tier.counters()["corrupt"] == 0
        assert not list(disk.rglob("*.tmp"))
    finally:
        close(tier)


def test_writer_killed_mid_write_leaves_a_readable_tier(factory_id, tmp_path):
    spec = Spec(factory_id, str(tmp_path), capacity="8MiB")
    proc = start_worker(spec, "put_forever", size=200 * KiB, batch=4)
    stored: list[str] = []
    try:
        while len(stored) < 16:
            line = proc.stdout.readline()
            assert line, f"worker died: {proc.stderr.read()[-2000:]}"
            stored += json.loads(line)["stored"]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    tier = open_spec(replace(spec, extra={"stale_temp_after_s": 0.001}
                             if factory_id == "sharedfs" else None))
    try:
        if factory_id == "sharedfs":
            tier._sweep.result(timeout=30)  # the crashed writer's temps are gone
            assert not list(Path(tier.root).rglob("*.tmp"))
        assert tier.test_index.pending_count() == 0
        outs = [out_for(200 * KiB) for _ in stored]
        res = tier.get(stored, outs)
        hits = [check_hit(k, o, r, 200 * KiB) for k, o, r in zip(stored, outs, res)]
        # FIFO reclaim may have dropped the oldest; whatever is served is right, and the
        # last batch the writer reported is there.
        assert all(h or r == MISS for h, r in zip(hits, res)) and all(hits[-4:])
        assert tier.counters()["corrupt"] == 0
        for b in range(0, 80, 4):  # five times the capacity after the crash
            keys = keys_for(5000 + b, 4)
            assert tier.put(keys, [frame_for(k, 200 * KiB) for k in keys]) == [True] * 4
        assert tier.used_bytes() <= tier.capacity_bytes
    finally:
        close(tier)
