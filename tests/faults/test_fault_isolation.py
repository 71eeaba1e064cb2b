"""Isolation and exposure: no key or path escapes a tier root, files are private, tenants and
models never read each other's blocks, ports bind loopback, nothing stored is unpickled.

- Paths: any string that is not a block key is refused before it becomes a sharedfs path;
  every key maps to `root/ab/cd/<key>.kvb`. nvme allocations stay inside their region and
  the data file, and hostile index locations are misses, never reads of other bytes.
- Modes: under umask 0 (the worst case), everything kvtier creates (index directory and its
  parents, LMDB files, nvme data file, sharedfs directories, files and quarantine, the
  embedded master's log and lock) is 0700 / 0600, or the policy's sharedfs `file_mode`.
- Tenants: two policies with different tenants (and models) on one shared directory and one
  pool see none of each other's blocks, even under colliding file names.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import start_master
from fault_util import (KiB, frame_for, load_checked, make, out_for,  # noqa: F401
                        policy_dict, request_keys, store)
from kvtier.store.base.keys import KEY_HEX, NS_HEX, Namespace, block_keys, is_key
from kvtier.store.tiered import TieredStore
from kvtier.tiers.mooncake.master import free_port
from kvtier.tiers.nvme.region_rows import unpack_loc
from kvtier.tiers.sharedfs.files import QUARANTINE, block_path

SIZE = 8 * KiB
HEX = "0123456789abcdef"


# ---- paths ------------------------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(st.text(max_size=80) | st.text(alphabet=HEX + "./\\\0%", min_size=KEY_HEX,
                                       max_size=KEY_HEX))
def test_no_string_but_a_key_becomes_a_sharedfs_path(s):
    root = Path("/srv/kvtier/shared")
    if is_key(s):
        p = block_path(root, s)
        assert p.parent.parent.parent == root and p.name == s + ".kvb"
        assert p.parent.name == s[NS_HEX + 2:NS_HEX + 4] and ".." not in p.parts
    else:
        with pytest.raises(ValueError, match="not a kvtier block key"):
            block_path(root, s)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=HEX, min_size=KEY_HEX, max_size=KEY_HEX))
def test_every_key_stays_under_the_root(key):
    root = Path("/srv/kvtier/shared")
    resolved = Path(os.path.normpath(block_path(root, key)))
    assert resolved.is_relative_to(root) and len(resolved.relative_to(root).parts) == 3


BAD_KEYS = ["../../etc/passwd", "0" * NS_HEX + "/../../../../etc/shadow", "A" * KEY_HEX,
            "0" * (KEY_HEX - 1) + "\0", "", "0" * (KEY_HEX - 2) + " 0", None]


def test_hostile_keys_are_refused_by_the_store_and_the_file_tier(store):
    """The store refuses a batch with anything but keys; the tier that makes paths from
    keys (sharedfs) refuses them itself too. (nvme locates blocks through the index and the
    pool names objects by key: neither turns a key into a path.)"""
    good = request_keys("x", 1)[0]
    accepted = []
    calls = {"lookup": lambda k: store.lookup([good, k]),
             "load": lambda k: store.load([good, k], [out_for(SIZE), out_for(SIZE)]),
             "save": lambda k: store.save([k], [frame_for(good, SIZE)]),
             "shared.contains": lambda k: store.by_name["shared"].contains([k]),
             "shared.get": lambda k: store.by_name["shared"].get([k], [out_for(SIZE)]),
             "shared.delete": lambda k: store.by_name["shared"].delete([k])}
    for key in BAD_KEYS:
        for name, call in calls.items():
            try:
                call(key)
                accepted.append((name, key))
            except (ValueError, TypeError):  # TypeError: None is not even a string
                pass
    assert not accepted, f"hostile keys accepted: {accepted}"


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 256 * KiB), min_size=1, max_size=40))
def test_nvme_allocations_stay_inside_their_region_and_file(tmp_path_factory, sizes):
    root = tmp_path_factory.mktemp("alloc")
    with TieredStore(make(policy_dict(root)), node_id="n", mover=False) as s:
        nvme = s.by_name["nvme"]
        keys = request_keys("alloc", len(sizes))
        for k, n in zip(keys, sizes):
            nvme.put([k], [frame_for(k, n)])
        file_size = (nvme.path / "regions.kvr").stat().st_size
        for e in s.index.scan("nvme"):
            slot, _ = unpack_loc(e.loc_a)
            assert slot < nvme.n_regions and e.loc_b % 4096 == 0
            assert e.loc_b + e.size <= nvme.region_bytes
            assert slot * nvme.region_bytes + e.loc_b + e.size <= file_size


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # one store for all
@given(slot=st.integers(0, 2**32 - 1), gen=st.integers(0, 2**31), off=st.integers(0, 2**40))
def test_hostile_nvme_locations_are_misses_never_other_bytes(store, slot, gen, off):
    nvme = store.by_name["nvme"]
    keys = request_keys("loc", 2)
    if not all(nvme.contains(keys)):
        nvme.put(keys, [frame_for(k, SIZE) for k in keys])
    e = store.index.get("nvme", [keys[0]])[0]
    hostile = e.replace(loc_a=(gen << 32) | slot, loc_b=off)
    store.index.delete("nvme", [keys[0]])
    store.index.reserve([hostile])
    store.index.commit("nvme", [keys[0]])
    hits, wrong = load_checked(store, keys[:1], SIZE)
    assert wrong == []
    nvme.delete(keys[:1])


# ---- modes ------------------------------------------------------------------------------

@pytest.fixture
def umask0():
    old = os.umask(0)
    yield
    os.umask(old)


def modes_under(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


@pytest.mark.parametrize("file_mode", [0o600, 0o640])
def test_everything_kvtier_creates_is_private(tmp_path, umask0, monkeypatch, file_mode):
    home = tmp_path / "home"
    monkeypatch.setenv("KVTIER_HOME", str(home))
    data = policy_dict(tmp_path / "node", f"127.0.0.1:{free_port()}",
                       index={"path": str(tmp_path / "node" / "var" / "lib" / "index")})
    data["master"]["embedded"] = True  # the store starts and owns it: log and lock files
    data["tiers"][2]["file_mode"] = file_mode
    (tmp_path / "node").mkdir()
    os.chmod(tmp_path / "node", 0o700)
    with TieredStore(make(data), node_id="node-a", mover=False) as store:
        keys = request_keys("modes", 4)
        store.save(keys, [frame_for(k, SIZE) for k in keys])
        store.mover.drain()
        shared = store.by_name["shared"]
        block_path(shared.root, keys[0]).write_bytes(b"junk")  # to fill the quarantine
        store.by_name["dram"].delete(keys)
        store.by_name["nvme"].delete(keys)
        assert load_checked(store, keys, SIZE)[0] == [False, True, True, True]
        master = store.master
    master.stop()
    found = modes_under(tmp_path / "node") | {f"home/{k}": v for k, v in modes_under(home).items()}
    assert any(k.endswith("data.mdb") for k in found) and any(".log" in k for k in found)
    assert any(k.endswith(".lock") for k in found) and any(QUARANTINE in k for k in found)
    wrong = {}
    for name, mode in found.items():
        p = (tmp_path / "node" / name) if not name.startswith("home/") else tmp_path / name
        if p.is_dir():
            want = 0o700
        elif name.endswith(".kvb"):
            want = file_mode
        else:
            want = 0o600
        if mode != want:
            wrong[name] = oct(mode)
    assert not wrong, f"not private: {wrong}"


# ---- tenants and models -----------------------------------------------------------------

def tenant_store(root: Path, shared: Path, master, model: str, tenant: str) -> TieredStore:
    data = policy_dict(root, master.address, shared=shared,
                       namespace={"model": model, "tenant": tenant})
    return TieredStore(make(data), node_id=f"{model}-{tenant}", mover=False)


def tenant_keys(store: TieredStore, tokens) -> list[str]:
    ns = Namespace(model=store.policy.namespace.model, tenant=store.policy.namespace.tenant,
                   chunk_tokens=store.policy.chunk_tokens)
    return block_keys(ns, tokens)


@pytest.mark.parametrize("other", [("llama", "acme"), ("mistral", "default")])
def test_other_tenants_and_models_never_read_each_others_blocks(tmp_path, shared_master,
                                                                other):
    shared = tmp_path / "shared"
    a = tenant_store(tmp_path / "a", shared, shared_master, "llama", "default")
    b = tenant_store(tmp_path / "b", shared, shared_master, *other)
    try:
        tokens = list(range(16 * 6))
        ka, kb = tenant_keys(a, tokens), tenant_keys(b, tokens)
        assert [k[NS_HEX:] for k in ka] == [k[NS_HEX:] for k in kb]  # same tokens, same chain
        assert not set(ka) & set(kb)
        a.save(ka, [frame_for(k, SIZE) for k in ka])
        a.mover.drain()
        assert b.lookup(kb).hit_blocks == 0  # neither the pool nor sharedfs answers for A
        for k_a, k_b in zip(ka, kb):  # A's files planted under B's names: refused
            dst = block_path(b.by_name["shared"].root, k_b)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(block_path(a.by_name["shared"].root, k_a).read_bytes())
        assert load_checked(b, kb, SIZE)[0] == [False] * len(kb)
        assert b.by_name["shared"].counters()["corrupt"] == len(kb)
        hits, wrong = load_checked(a, ka, SIZE)  # A still reads its own, intact
        assert all(hits) and wrong == []
    finally:
        b.close()
        a.close()
