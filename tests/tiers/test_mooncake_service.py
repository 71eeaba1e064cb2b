"""The mooncake tier through the node's pool service (`service` set): joining or starting the
service, zero-copy shared memory, the service's segment, and a service that dies.

The contract suite runs this mode too (factory `mooncake-service`), including blocks that
outlive the process that put them and processes writing while another reads.
"""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import pytest

from conftest import answered, make_policy
from kvtier.store.base.block import HEADER_SIZE, encode
from kvtier.store.base.errors import TierUnavailableError
from kvtier.store.base.index import Index
from kvtier.store.base.keys import Namespace
from kvtier.tiers import MISS, TierContext, open_tier
from kvtier.tiers.mooncake.master import free_port, master_answers
from kvtier.tiers.mooncake.service import (PoolService, read_segment, service_log,
                                          service_segment)

NS = Namespace(model="kvtier-test-pool-service").fingerprint()


def frames_for(n: int, size: int) -> tuple[list[str], list[bytearray]]:
    keys = [NS + os.urandom(16).hex() for _ in range(n)]
    return keys, [encode(k, os.urandom(size)) for k in keys]


def open_joined(root: Path, master, service: str, name: str = "index", **tier):
    base = {"name": "dram", "kind": "mooncake", "capacity": "64MiB", "buffer": "16MiB",
            "staging": "32MiB", "retry_backoff_s": 0.01, "service": service}
    policy = make_policy(root, master_address=master.address, tiers=[{**base, **tier}])
    master_cfg = policy.master.model_copy(
        update={"extra_flags": {"metrics_port": str(master.metrics_port)}})
    index = Index(root / name, 16 << 20)
    return open_tier(policy.tiers[0], TierContext(index, "test", master_cfg))


def round_trip(tier, keys, frames) -> bool:
    assert tier.put(keys, frames) == [True] * len(keys)
    outs = [bytearray(len(f)) for f in frames]
    got = tier.get(keys, outs)
    return got == [len(f) - HEADER_SIZE for f in frames] and outs == frames


def test_first_tier_starts_the_service_and_the_next_joins_it(tmp_path, mooncake_master):
    address = f"127.0.0.1:{free_port()}"
    a = open_joined(tmp_path, mooncake_master, address, "index-a")
    b = open_joined(tmp_path, mooncake_master, address, "index-b")
    try:
        assert a.client.owned_service is not None and a.client.owned_service.alive()
        assert b.client.owned_service is None  # joined the one answering
        keys, frames = frames_for(4, 100_000)
        assert a.put(keys, frames) == [True] * 4
        outs = [bytearray(len(f)) for f in frames]
        assert b.get(keys, outs) == [100_000] * 4 and outs == frames
        # Puts land in the service's segment, which the master counts and the tier reports.
        run = a.client.master.runtime_dir
        segment = service_segment(service_log(a.cfg, run))
        assert segment and a.client.segment == segment == read_segment(address, run)
        text = urllib.request.urlopen(mooncake_master.metrics_url, timeout=5).read().decode()
        used = re.search(rf'segment_allocated_bytes\{{segment="{re.escape(segment)}"\}} (\S+)',
                         text)
        assert used and int(float(used.group(1))) >= 4 * 100_000
        assert a.used_bytes() >= 4 * 100_000
    finally:
        b.close()
        a.close()
        a.client.owned_service.stop()
    assert read_segment(address, run) == ""  # the stopped service withdrew its segment's name


def test_shared_memory_is_zero_copy_and_foreign_memory_is_staged(tmp_path, mooncake_master):
    with PoolService(open_joined_cfg(tmp_path, mooncake_master), _master(mooncake_master)) as svc:
        tier = open_joined(tmp_path, mooncake_master, svc.address, service_embedded=False)
        try:
            shared = tier.alloc_shared(2 << 20)
            assert tier.client.registered(_addr(shared), len(shared))
            private = bytearray(1 << 20)
            tier.register(private)  # a service cannot map it: no error, staged instead
            assert not tier.client.registered(_addr(memoryview(private)), len(private))
            keys, frames = frames_for(2, 200_000)
            for i, f in enumerate(frames):
                shared[i * 262144:i * 262144 + len(f)] = f
            views = [shared[i * 262144:i * 262144 + len(f)] for i, f in enumerate(frames)]
            assert tier.put(keys, views) == [True, True]
            outs = [shared[600_000 + i * 262144:600_000 + i * 262144 + len(f)]
                    for i, f in enumerate(frames)]
            assert tier.get(keys, outs) == [200_000, 200_000]
            assert [bytes(o) for o in outs] == [bytes(f) for f in frames]
            assert round_trip(tier, *frames_for(3, 50_000))  # unregistered buffers
        finally:
            tier.close()


def test_no_service_and_embedding_off_is_a_clear_error(tmp_path, mooncake_master):
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(TierUnavailableError, match=r"no pool service answers at .*kvtier "
                                                   r"pool-service"):
        open_joined(tmp_path, mooncake_master, address, service_embedded=False)
    assert not master_answers(address)


def test_a_killed_service_is_unavailable_then_replaced_in_the_background(tmp_path,
                                                                        mooncake_master):
    address = f"127.0.0.1:{free_port()}"
    tier = open_joined(tmp_path, mooncake_master, address)
    try:
        first = tier.client.owned_service
        old_staging = tier.staging
        keys, frames = frames_for(3, 300_000)
        assert round_trip(tier, keys, frames)
        first.kill()  # the node's DRAM is gone with it
        with pytest.raises(TierUnavailableError, match="pool service"):
            tier.get(keys, [bytearray(len(f)) for f in frames])
        # A reconnect in the background starts a new service (embedded) and maps fresh
        # shared memory.
        got = answered(lambda: tier.get(keys, [bytearray(len(f)) for f in frames]))
        assert got == [MISS] * 3
        assert tier.client.owned_service is not first and tier.client.owned_service.alive()
        assert _addr(tier.staging) != _addr(old_staging)
        assert round_trip(tier, *frames_for(3, 300_000))
    finally:
        tier.close()
        if tier.client.owned_service is not None:
            tier.client.owned_service.stop()


def test_service_outlives_its_clients(tmp_path, mooncake_master):
    with PoolService(open_joined_cfg(tmp_path, mooncake_master), _master(mooncake_master)) as svc:
        keys, frames = frames_for(3, 64_000)
        a = open_joined(tmp_path, mooncake_master, svc.address, "index-a",
                        service_embedded=False)
        assert a.put(keys, frames) == [True] * 3
        a.close()
        b = open_joined(tmp_path, mooncake_master, svc.address, "index-b",
                        service_embedded=False)
        try:
            outs = [bytearray(len(f)) for f in frames]
            assert b.get(keys, outs) == [64_000] * 3 and outs == frames
        finally:
            b.close()


def test_a_service_names_its_segment_in_a_new_run_dir_and_a_stranger_is_told(
        tmp_path, mooncake_master, caplog):
    """The segment's name goes to the starter's run dir, made if missing; a process with
    another run dir cannot find it and says what that costs and how to fix it."""
    from kvtier.store.base.config import MasterConfig
    run = tmp_path / "not" / "yet" / "run"
    master = MasterConfig(address=mooncake_master.address, embedded=False, run_dir=run)
    with PoolService(open_joined_cfg(tmp_path, mooncake_master), master) as svc:
        assert read_segment(svc.address, run)
        with caplog.at_level("WARNING", logger="kvtier.tiers.mooncake.client"):
            stranger = open_joined(tmp_path, mooncake_master, svc.address,
                                   service_embedded=False)
        try:
            assert stranger.client.segment == ""
            assert any("named no segment" in r.getMessage() and "master.run_dir" in
                       r.getMessage() for r in caplog.records)
        finally:
            stranger.close()


# ---- helpers -------------------------------------------------------------------------

def open_joined_cfg(root: Path, master):
    policy = make_policy(root, master_address=master.address, tiers=[
        {"name": "dram", "kind": "mooncake", "capacity": "64MiB", "buffer": "16MiB",
         "service": f"127.0.0.1:{free_port()}"}])
    return policy.tiers[0]


def _master(master):
    from kvtier.store.base.config import MasterConfig
    return MasterConfig(address=master.address, embedded=False)


def _addr(view) -> int:
    from kvtier.store.base.block import buffer_address
    return buffer_address(view)


def test_a_late_load_through_a_service_blames_no_lender_and_logs_no_rpc_error(
        tmp_path, mooncake_master, capfd):
    """A pool service cannot say which client lends a block (its clients all use the
    service's segment, and this Mooncake's service answers no replica query: each try logs
    an RPC error): a late load counts as `unknown` without asking."""
    address = f"127.0.0.1:{free_port()}"
    tier = open_joined(tmp_path, mooncake_master, address)
    try:
        keys, frames = frames_for(3, 10_000)
        assert tier.put(keys, frames) == [True] * 3
        capfd.readouterr()
        assert tier.lenders_of(keys) == [[], [], []]
        tier._blame(keys, late=True)
        assert tier.lender_failures() == {"unknown": 3}
        assert tier.unreachable.blocked() == set()  # nothing to keep out of lookups
        err = capfd.readouterr().err
        assert "not registered" not in err and "replica failed" not in err, err
    finally:
        tier.close()
        tier.client.owned_service.stop()
