"""Hostile and corrupt bytes in every tier, met through `TieredStore.load`.

Each block is stored in all three tiers (pool, nvme, sharedfs), then every copy but the one
under test is dropped and that copy is damaged in place: bit flips (payload and header),
truncation, a zero-length object, a wrong header, another model's block under the colliding
name (same chain, other namespace), and a valid block of another key in the wrong place.
The store must answer MISS (never the bytes), count the corruption, quarantine the copy (the
pool object removed, the nvme entry dropped, the sharedfs file moved to `.quarantine`) and
keep answering MISS. A damaged fast copy over a good slow one serves the good bytes.

Symlinks planted in the sharedfs tree (in place of a block file, or of a fan-out directory)
pointing outside it are never followed: not read, not moved, not deleted through, not written
through; the target outside keeps its bytes.
"""

from __future__ import annotations

import os

import pytest

from fault_util import (OTHER_NS, KiB, frame_for, load_checked, make, out_for,  # noqa: F401
                        policy_dict, request_keys, store)
from kvtier.store.base import block
from kvtier.store.base.keys import NS_HEX
from kvtier.store.tiered import TieredStore
from kvtier.tiers import MISS
from kvtier.tiers.nvme.regions import unpack_loc
from kvtier.tiers.sharedfs.files import QUARANTINE, block_path

SIZE = 16 * KiB
TIERS = ("dram", "nvme", "shared")


def flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at % len(b)] ^= 0x10
    return bytes(b)


def foreign(key: str) -> bytes:
    """Another model's block for the same tokens: same chain hash, other namespace."""
    other = OTHER_NS.fingerprint() + key[NS_HEX:]
    return bytes(frame_for(other, SIZE))


def misplaced(key: str) -> bytes:
    """A valid block of another key of the same model, stored under this key's name."""
    return bytes(frame_for(key[:-4] + "beef" if not key.endswith("beef") else key[:-4] + "f00d",
                           SIZE))


DAMAGE = {
    "payload-bit-flip": lambda k, f: flip(f, block.HEADER_SIZE + SIZE // 2),
    "header-bit-flip": lambda k, f: flip(f, 9),
    "checksum-field-flip": lambda k, f: flip(f, 50),
    "truncated": lambda k, f: f[:len(f) // 2],
    "header-only": lambda k, f: f[:block.HEADER_SIZE],
    "zero-length": lambda k, f: b"",
    "wrong-magic": lambda k, f: b"KVTX" + f[4:],
    "other-namespace": lambda k, f: foreign(k),
    "misplaced-key": lambda k, f: misplaced(k),
    "trailing-junk": lambda k, f: f + b"junk",
}


def stored_everywhere(store: TieredStore, keys: list[str]) -> None:
    assert all(store.save(keys, [frame_for(k, SIZE) for k in keys]))
    store.mover.drain()
    for t in TIERS:
        assert all(store.by_name[t].contains(keys)), t


def raw_write(store: TieredStore, tier: str, key: str, data: bytes) -> None:
    """Replace the stored bytes of `key` in `tier` behind the store's back."""
    t = store.by_name[tier]
    if tier == "dram":
        with t.client.session() as mc:
            mc.remove(key, True)
            if data:
                assert mc.put(key, data, t.client.replicate) == 0
            else:  # Mooncake refuses empty objects: the closest is a one-byte one
                assert mc.put(key, b"\0", t.client.replicate) == 0
    elif tier == "nvme":
        e = store.index.get("nvme", [key])[0]
        off = unpack_loc(e.loc_a)[0] * t.region_bytes + e.loc_b
        data = data[:e.size] + bytes(max(0, e.size - len(data)))  # a slot keeps its size
        fd = os.open(t.path / "regions.kvr", os.O_WRONLY)
        try:
            os.pwrite(fd, data, off)
            os.fsync(fd)  # the tier reads with O_DIRECT
        finally:
            os.close(fd)
    else:
        block_path(t.root, key).write_bytes(data)


def only_in(store: TieredStore, tier: str, key: str) -> None:
    for t in TIERS:
        if t != tier:
            store.by_name[t].delete([key])
    assert store.lookup([key]).tiers == (tier,)


@pytest.mark.parametrize("tier", TIERS)
def test_damaged_copies_are_never_served_and_are_quarantined(store, tier):
    # An nvme slot is exactly one frame long: bytes after it cannot be stored there.
    damages = {n: d for n, d in DAMAGE.items() if not (tier == "nvme" and n == "trailing-junk")}
    keys = request_keys(f"hostile-{tier}", len(damages))
    stored_everywhere(store, keys)
    t = store.by_name[tier]
    for key, (name, damage) in zip(keys, damages.items()):
        only_in(store, tier, key)
        frame = bytes(frame_for(key, SIZE))
        raw_write(store, tier, key, damage(key, frame))
        before = t.counters()["corrupt"]
        hits, wrong = load_checked(store, [key], SIZE)
        assert hits == [False] and wrong == [], f"{tier}/{name}: damaged bytes were served"
        assert t.counters()["corrupt"] == before + 1, f"{tier}/{name}: not counted"
        assert t.contains([key]) == [False], f"{tier}/{name}: not quarantined"
        assert store.lookup([key]).hit_blocks == 0
        assert load_checked(store, [key], SIZE)[0] == [False]
        if tier != "dram":
            assert store.index.get(tier, [key], ready_only=False) == [None]
    if tier == "shared":
        moved = list((t.root / QUARANTINE).iterdir())
        assert len(moved) == len(damages), moved


@pytest.mark.parametrize("tier", ("dram", "nvme"))
def test_a_damaged_fast_copy_falls_through_to_the_good_slow_one(store, tier):
    keys = request_keys(f"fallthrough-{tier}", 3)
    stored_everywhere(store, keys)
    for above in TIERS[:TIERS.index(tier)]:
        store.by_name[above].delete(keys)
    for key in keys:
        raw_write(store, tier, key, flip(bytes(frame_for(key, SIZE)), block.HEADER_SIZE + 7))
    hits, wrong = load_checked(store, keys, SIZE)
    assert hits == [True] * 3 and wrong == []
    assert store.by_name[tier].counters()["corrupt"] == 3


def test_a_symlinked_block_file_is_refused_and_its_target_untouched(store, tmp_path):
    key = request_keys("link-file", 1)[0]
    stored_everywhere(store, [key])
    only_in(store, "shared", key)
    target = tmp_path / "outside.kvb"  # a valid frame: only O_NOFOLLOW keeps it out
    target.write_bytes(bytes(frame_for(key, SIZE)))
    path = block_path(store.by_name["shared"].root, key)
    path.unlink()
    path.symlink_to(target)
    assert load_checked(store, [key], SIZE)[0] == [False]
    assert target.read_bytes() == bytes(frame_for(key, SIZE))
    assert not path.is_symlink() and not path.exists()


def test_a_symlinked_fanout_directory_is_never_followed(store, tmp_path):
    """A planted directory link: writes, deletes and reads through it are all refused."""
    shared = store.by_name["shared"]
    key = request_keys("link-dir", 1)[0]
    stored_everywhere(store, [key])
    only_in(store, "shared", key)
    path = block_path(shared.root, key)
    outside = tmp_path / "outside"
    (outside / path.parent.name).mkdir(parents=True)
    planted = outside / path.parent.name / path.name
    planted.write_bytes(bytes(frame_for(key, SIZE)))  # valid bytes, reachable only by link
    real = path.parent.parent
    os.rename(real, tmp_path / "moved-away")
    real.symlink_to(outside, target_is_directory=True)
    # a write under the link: the store's persist meets it, refuses, leaves no reservation
    other = key[:NS_HEX + 4] + "0" * (len(key) - NS_HEX - 4)
    assert block_path(shared.root, other).parent.parent == real
    store.save([other], [frame_for(other, SIZE)])
    store.mover.drain()
    assert store.mover.stats["copy_errors"] == 1 and not shared.contains([other])[0]
    assert store.index.pending_count() == 0, "a refused write left its reservation behind"
    assert sorted(p.name for p in outside.rglob("*")) == sorted([path.parent.name, path.name])
    shared.delete([key])  # a delete does not unlink through the link
    assert planted.read_bytes() == bytes(frame_for(key, SIZE))
    assert shared.get([key], [out_for(SIZE)]) == [MISS], "a read followed a directory link"
    assert planted.read_bytes() == bytes(frame_for(key, SIZE)), "the target was touched"
    assert not real.is_symlink(), "the planted link stays in the tree"
    assert any(p.name.startswith("dir-") for p in (shared.root / QUARANTINE).iterdir())
    store.save([other], [frame_for(other, SIZE)])  # with the link gone, writes work again
    store.mover.drain()
    assert shared.contains([other]) == [True] and not real.is_symlink()
