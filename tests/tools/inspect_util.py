"""Helpers of the `kvtier inspect` tests: a small real store, its blocks, and the planting of
each kind of inconsistency for real (bytes flipped in the data file, entries rewritten in the
LMDB index, files removed, truncated, replaced by links, writers SIGKILLed).

Blocks are deterministic (`payload_of`), so any process can tell a block's right bytes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from kvtier.store.base import block
from kvtier.store.base.config import load_policy
from kvtier.store.base.index import Index
from kvtier.store.base.index_record import Entry, encode_entry
from kvtier.store.base.keys import Namespace, block_keys
from kvtier.store.tiered import SessionHint, TieredStore
from kvtier.tiers import MISS
from kvtier.tiers.nvme.region_rows import BLK, unpack_loc
from kvtier.tiers.sharedfs.files import block_path

PAYLOAD = 40_000
NS = Namespace(model="inspect-test", chunk_tokens=16)
WORKER = Path(__file__).with_name("inspect_worker.py")


def policy_data(root: Path, master_address: str | None = None, nvme: str = "16MiB") -> dict:
    """nvme and sharedfs (and the pool, given a master), persisting every block at once."""
    tiers = [{"name": "nvme", "kind": "nvme", "path": str(root / "nvme"), "capacity": nvme,
              "region_size": "1MiB"},
             {"name": "shared", "kind": "sharedfs", "path": str(root / "shared"),
              "capacity": "64MiB"}]
    if master_address:
        tiers.insert(0, {"name": "dram", "kind": "mooncake", "capacity": "16MiB",
                         "buffer": "16MiB", "staging": "8MiB"})
    return {"chunk_tokens": 16, "index": {"path": str(root / "index"), "map_size": "64MiB"},
            "master": {"address": master_address or "127.0.0.1:1", "embedded": False},
            "tiers": tiers, "admission": {"kind": "always"},
            "mover": {"interval_s": 0.05, "buffer": "8MiB"}}


def write_policy(root: Path, master_address: str | None = None, **kw):
    """(path of the policy YAML, the loaded policy)."""
    path = root / "policy.yaml"
    path.write_text(yaml.safe_dump(policy_data(root, master_address, **kw)))
    return path, load_policy(path)


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


def session_keys(n_sessions: int, blocks: int, first: int = 0) -> dict[str, list[str]]:
    """Session id -> the keys of its prompt (sessions share no block)."""
    return {f"s{i}": block_keys(NS, range(i * 100_000, i * 100_000 + 16 * blocks))
            for i in range(first, first + n_sessions)}


def fill(policy, sessions: dict[str, list[str]], finish: bool = True,
         waits_for: dict[str, str] | None = None) -> None:
    """Save each session's blocks through a TieredStore and persist them to every tier;
    each turn ends waiting for `waits_for[session]` (the gap class), if given."""
    with TieredStore(policy, mover=False) as store:
        for sid, keys in sessions.items():
            hint = SessionHint(sid)
            store.lookup(keys, hint)
            assert all(store.save(keys, frames_for(keys), hint))
            if finish:
                store.finish(keys, SessionHint(sid, gap_class=(waits_for or {}).get(sid)))
        store.mover.drain()


def readable(policy, tier: str, keys: list[str]) -> list[bool]:
    """Which keys `tier` returns with exactly their bytes (opened the way instances do)."""
    with TieredStore(policy, mover=False, start_master=False) as store:
        outs = [block.alloc_aligned(block.frame_size(PAYLOAD, block.PAGE)) for _ in keys]
        got = store.by_name[tier].get(keys, outs)
    return [n != MISS and bytes(o[block.HEADER_SIZE:block.HEADER_SIZE + n]) == payload_of(k)
            for k, o, n in zip(keys, outs, got)]


# ---- planting --------------------------------------------------------------------------

def rewrite_entry(index: Index, tier: str, key: str, **changes) -> Entry:
    """Overwrite an entry's record in the index (counters untouched, as a bug would)."""
    e = index.get(tier, [key], ready_only=False)[0]
    assert e is not None, f"{key} has no entry in {tier}"
    with index._txn(write=True) as txn:
        txn.put(index._k(key, tier), encode_entry(e.replace(**changes)), db=index._db("blocks"))
    return e


def nvme_offset(index: Index, key: str, region_bytes: int = 1 << 20) -> int:
    e = index.get("nvme", [key])[0]
    return unpack_loc(e.loc_a)[0] * region_bytes + e.loc_b


def flip_byte(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x10]), offset)
        os.fsync(fd)  # the tier reads with O_DIRECT: the bytes must be on disk
    finally:
        os.close(fd)


def drop_region_row(index: Index, key: str) -> None:
    """Delete the region table's record of where `key` was allocated."""
    e = index.get("nvme", [key])[0]
    slot, gen = unpack_loc(e.loc_a)
    index.open_table("nvme.nvme")
    db = index._db("nvme.nvme")
    with index._txn(write=True) as txn:
        assert txn.delete(b"B" + BLK.pack(slot, gen, e.loc_b), db=db)


def shared_file(root: Path, key: str) -> Path:
    return block_path(root / "shared", key)


def aged(path: Path, seconds: float) -> Path:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)
    return path


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def start_worker(mode: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), mode, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_line(proc: subprocess.Popen, timeout_s: float = 60) -> dict:
    """The next JSON line the worker prints (it prints nothing else on stdout)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return json.loads(line)
        if not line and proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
    raise AssertionError("worker did not answer in time")


def kill_pending_writer(index_path: Path, tier: str, key: str) -> int:
    """Spawn a process that reserves `key` PENDING in `tier`, SIGKILL it; return its pid."""
    proc = start_worker("pending", index_path, tier, key)
    wait_line(proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    return proc.pid


def tree_state(root: Path) -> dict:
    """Every path under `root` with its type, size and mtime (what a read-only run keeps)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            out[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def index_state(index: Index) -> dict:
    """Every row of the index's tables (what a read-only run keeps)."""
    for n in ("nvme.nvme", "sharedfs.shared"):
        index.open_table(n)
    dbs = {n: index._db(n) for n in ("blocks", "pending", "tierstats", "sessions", "meta",
                                     "nvme.nvme", "sharedfs.shared")}
    with index._txn(write=False) as txn:
        return {n: dict(txn.cursor(db=db)) for n, db in dbs.items()}
