"""The node's LMDB index: where every block this node knows lives, and in what state.

Named databases:
- `blocks`: (24-byte key, 1-byte tier id) -> `Entry` record (state, location, size, checksum,
  session, times, owner while PENDING). One entry per copy: a block in dram and on nvme has two.
- `pending`: the (key, tier) pairs in state PENDING, so recovery never scans all blocks.
- `tierstats`: tier id -> READY block count and bytes, kept in the same transactions.
- `sessions`, `meta`, and tables that other modules open by name (`table()`).

Two-phase writes: `reserve` (PENDING, owned by this process) -> bytes written -> `commit`
(READY) or `abort`. Lookups see only READY entries. A PENDING entry whose owner process is
dead was left by a crash; `recover()` (run on open) removes it and returns it so the tier can
release the space. Several processes of one node may use one index at once (LMDB's own
locking); each opens it after fork/spawn, never across: `Index` reopens itself in a new pid.

This module is the one door to LMDB: no other module of kvtier touches an LMDB handle. The
tables other modules keep here (the nvme regions, the sharedfs age queue, counters, sessions)
are reached through `Txn`, by name; the `blocks`, `pending`, `tierstats` and `meta` tables only
through `Index`'s own methods, so their invariants (usage counted in the same transaction as
every commit and delete) cannot be broken from outside.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import lmdb

from kvtier.store.base.errors import IndexError_, IndexFullError
from kvtier.store.base.index_record import (PENDING, READY, Entry, decode_entry, encode_entry,
                                            owner_alive)
from kvtier.store.base.keys import key_bytes
from kvtier.store.base.units import format_size

SCHEMA_VERSION = 1
FILE_MODE, DIR_MODE = 0o600, 0o700  # the index names every block a node holds: private
_DBS = ("blocks", "pending", "tierstats", "sessions", "meta")
_SHARED_DBS = frozenset({"sessions"})  # the built-in tables `Txn` may reach by name
_MAX_DBS = 32
T = TypeVar("T")


class Txn:
    """One index transaction as other modules see it: their own tables, by name, and this
    node's block entries, read-only. Valid only inside the `with` (or `run_write` call) that
    made it; a read transaction refuses writes (LMDB raises)."""

    def __init__(self, index: "Index", txn: lmdb.Transaction):
        self._index, self._txn = index, txn

    def get(self, table: str, key: bytes) -> bytes | None:
        raw = self._txn.get(key, db=self._index._named(table))
        return None if raw is None else bytes(raw)

    def put(self, table: str, key: bytes, value: bytes) -> None:
        self._txn.put(key, value, db=self._index._named(table))

    def delete(self, table: str, key: bytes) -> bool:
        """Remove the row; False if there was none."""
        return self._txn.delete(key, db=self._index._named(table))

    def rows(self, table: str, prefix: bytes = b"", start: bytes | None = None
             ) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) rows of `table` whose key starts with `prefix`, in key order, from
        `start` on (default: the first such row). Do not change `table` while iterating."""
        cur = self._txn.cursor(db=self._index._named(table))
        if not cur.set_range(prefix if start is None else max(start, prefix)):
            return
        for k, v in cur:
            if not k.startswith(prefix):
                return
            yield bytes(k), bytes(v)

    def count(self, table: str) -> int:
        """How many rows `table` holds (from LMDB's own count: no scan)."""
        return self._txn.stat(self._index._named(table))["entries"]

    def entry(self, tier: str, key: str) -> Entry | None:
        """The entry of `key` in `tier`, in any state, or None."""
        raw = self._txn.get(self._index._k(key, tier), db=self._index._dbs["blocks"])
        return decode_entry(raw, key, tier) if raw is not None else None

    def ready_page(self, tier: str, after: bytes = b"", limit: int = 16384
                   ) -> tuple[list[Entry], bytes | None]:
        """Up to `limit` READY entries of `tier`, in key order, after the row `after` (b"" at
        first), and the row the next page starts after (None: this was the last)."""
        tid, rows, nxt = self._index.tier_id(tier), [], None
        cur = self._txn.cursor(db=self._index._dbs["blocks"])
        seen = 0
        if cur.set_range(after):
            for k, raw in cur:
                if k == after or k[24] != tid:
                    continue
                e = decode_entry(raw, k[:24].hex(), tier)
                if e.state == READY:
                    rows.append(e)
                seen += 1
                if seen >= limit:
                    nxt = bytes(k)
                    break
        return rows, nxt


def make_private_dirs(path: Path) -> None:
    """Create `path` and every missing parent 0700 (`mkdir(parents=True)` would give the
    parents the umask's default, often world-readable)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir(mode=DIR_MODE, exist_ok=True)


class Index:
    """A process-local handle on the node's LMDB index (thread-safe)."""

    def __init__(self, path: str | os.PathLike[str], map_size_bytes: int = 1 << 30,
                 max_map_size_bytes: int = 64 << 30, identity: str | None = None,
                 recover: bool = True, readonly: bool = False, chunk_tokens: int | None = None):
        self.path = Path(path)
        self.max_map_size_bytes = max(max_map_size_bytes, map_size_bytes)
        self._map_size = map_size_bytes
        self._readonly = readonly
        self._identity = identity
        self._chunk_tokens = chunk_tokens
        self._lock = threading.Condition()
        self._active = 0
        self._tier_ids: dict[str, int] = {}
        self._table_names: set[str] = set()
        self._open()
        if recover and not readonly:
            self.recover()

    # ---- opening, growing, txns -------------------------------------------------------

    def _open(self) -> None:
        if not self._readonly:
            try:
                make_private_dirs(self.path)
            except OSError as e:
                raise IndexError_(f"cannot create index directory {self.path} ({e.strerror}); "
                                  "set index.path to a writable directory") from None
        elif not (self.path / "data.mdb").exists():
            raise IndexError_(f"no kvtier index at {self.path}; check index.path in the policy")
        try:
            self._env = lmdb.open(str(self.path), map_size=self._map_size, max_dbs=_MAX_DBS,
                                  max_readers=1024, readonly=self._readonly, lock=True,
                                  readahead=False, meminit=False, mode=FILE_MODE)
        except lmdb.Error as e:
            raise IndexError_(f"cannot open the index at {self.path}: {e}; check index.path "
                              "and its permissions") from None
        self._pid = os.getpid()
        self._dbs = {name: self._env.open_db(name.encode(), create=not self._readonly)
                     for name in _DBS}
        self._extra: dict[str, object] = {}
        self._map_size = self._env.info()["map_size"]
        if not self._readonly:
            self._check_meta()
        for name in sorted(self._table_names):  # after a fork: the tables the parent opened
            self._open_extra(name)

    def _check_meta(self) -> None:
        with self._txn(write=True) as txn:
            db = self._dbs["meta"]
            version = txn.get(b"schema_version", db=db)
            if version is None:
                txn.put(b"schema_version", str(SCHEMA_VERSION).encode(), db=db)
            elif int(version) != SCHEMA_VERSION:
                raise IndexError_(f"index at {self.path} has schema {int(version)}, this kvtier "
                                  f"reads {SCHEMA_VERSION}; use a new index.path")
            if self._identity is not None:
                have = txn.get(b"identity", db=db)
                if have is None:
                    txn.put(b"identity", self._identity.encode(), db=db)
                elif have.decode() != self._identity:
                    raise IndexError_(f"index at {self.path} belongs to namespace "
                                      f"{have.decode()!r}, the policy says {self._identity!r}; "
                                      "point index.path elsewhere or fix namespace")
            if self._chunk_tokens is not None:
                # Another chunk size names every block differently: all misses, silently.
                have = txn.get(b"chunk_tokens", db=db)
                if have is None:
                    txn.put(b"chunk_tokens", str(self._chunk_tokens).encode(), db=db)
                elif int(have) != self._chunk_tokens:
                    raise IndexError_(f"index at {self.path} holds blocks of chunk_tokens "
                                      f"{int(have)}, the policy says {self._chunk_tokens}; set "
                                      "chunk_tokens to match or point index.path elsewhere")

    def _ensure_pid(self) -> None:
        if os.getpid() != self._pid:
            # An LMDB environment must never be used across a fork. Closing the inherited
            # handle in the child is safe (mdb_env_close clears only this pid's reader slots,
            # and fcntl locks are not inherited); then the child opens its own.
            self._env.close()
            self._open()

    @contextmanager
    def _txn(self, write: bool) -> Iterator[lmdb.Transaction]:
        self._ensure_pid()
        with self._lock:
            self._active += 1
        try:
            while True:
                try:
                    txn = self._env.begin(write=write)
                    break
                except lmdb.MapResizedError:
                    self._env.set_mapsize(0)  # another process grew the map: adopt its size
            with txn:
                yield txn
        finally:
            with self._lock:
                self._active -= 1
                self._lock.notify_all()

    @contextmanager
    def read(self) -> Iterator[Txn]:
        """A read transaction on other modules' tables (`Txn`): one consistent snapshot."""
        with self._txn(write=False) as txn:
            yield Txn(self, txn)

    def run_write(self, fn: Callable[[Txn], T]) -> T:
        """Run `fn(txn)` in one write transaction (`Txn`), growing the map and retrying
        when it is full (so `fn` may run more than once: keep it free of side effects)."""
        return self._run_write(lambda txn: fn(Txn(self, txn)))

    def _run_write(self, fn):
        while True:
            try:
                with self._txn(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                self._grow()

    def _grow(self) -> None:
        new = min(self._map_size * 2, self.max_map_size_bytes)
        if new <= self._map_size:
            raise IndexFullError(f"index at {self.path} is full ({format_size(self._map_size)}); "
                                 "raise index.max_map_size or run `kvtier inspect gc`")
        with self._lock:
            while self._active:
                self._lock.wait()
            self._env.set_mapsize(new)
            self._map_size = new

    def close(self) -> None:
        if os.getpid() == self._pid:
            self._env.close()

    def open_table(self, name: str) -> bool:
        """Make the table `name` (another module's rows, e.g. nvme regions) reachable through
        `Txn` by name; False if it does not exist in a read-only index. Call it outside any
        transaction of this thread: opening a table takes LMDB's write lock."""
        self._ensure_pid()
        if name in _DBS:
            raise ValueError(f"table {name!r} is the index's own; use Index's methods")
        self._table_names.add(name)
        return self._open_extra(name)

    def _open_extra(self, name: str) -> bool:
        if name in self._extra:
            return True
        if self._readonly:
            try:
                self._extra[name] = self._env.open_db(name.encode(), create=False)
            except lmdb.NotFoundError:
                return False
            return True
        # open_db without a txn begins its own write txn while holding the GIL: if
        # another thread holds the write lock and needs the GIL to commit, both wait
        # forever. Our own txn's begin releases the GIL while it waits for the lock.
        with self._txn(write=True) as txn:
            self._extra[name] = self._env.open_db(name.encode(), txn=txn)
        return True

    def _db(self, name: str):
        """The LMDB handle of any table (for tests that plant faults; kvtier never uses it)."""
        return self._dbs[name] if name in self._dbs else self._named(name)

    def _named(self, name: str):
        if name in _SHARED_DBS:
            return self._dbs[name]
        try:
            return self._extra[name]
        except KeyError:
            raise KeyError(f"index table {name!r} is not open; call Index.open_table first"
                           ) from None

    @property
    def map_size_bytes(self) -> int:
        return self._map_size

    # ---- tier ids ---------------------------------------------------------------------

    def tier_id(self, name: str) -> int:
        """The stable one-byte id of tier `name` in this index (allocated on first use)."""
        if name in self._tier_ids:
            return self._tier_ids[name]

        def alloc(txn: lmdb.Transaction) -> int:
            db = self._dbs["meta"]
            found = txn.get(b"tier:" + name.encode(), db=db)
            if found is not None:
                return int(found)
            used = {int(v) for k, v in txn.cursor(db=db) if k.startswith(b"tier:")}
            new = next(i for i in range(1, 255) if i not in used)
            txn.put(b"tier:" + name.encode(), str(new).encode(), db=db)
            return new

        self._tier_ids[name] = (self._lookup_tier_id(name) if self._readonly
                                else self._run_write(alloc))
        return self._tier_ids[name]

    def _lookup_tier_id(self, name: str) -> int:
        with self._txn(write=False) as txn:
            found = txn.get(b"tier:" + name.encode(), db=self._dbs["meta"])
        return int(found) if found is not None else 255

    def tier_names(self) -> dict[int, str]:
        with self._txn(write=False) as txn:
            return {int(v): k[5:].decode() for k, v in txn.cursor(db=self._dbs["meta"])
                    if k.startswith(b"tier:")}

    # ---- the two-phase protocol -------------------------------------------------------

    def reserve(self, entries: Sequence[Entry]) -> list[bool]:
        """Mark entries PENDING, owned by this process. False where the (key, tier) exists."""
        now, pid = time.time(), os.getpid()
        ks = [self._k(e.key, e.tier) for e in entries]

        def go(txn: lmdb.Transaction) -> list[bool]:
            out = []
            for e, k in zip(entries, ks):
                if txn.get(k, db=self._dbs["blocks"]) is not None:
                    out.append(False)
                    continue
                rec = e.replace(state=PENDING, owner_pid=pid, created=e.created or now,
                                last_access=e.last_access or now)
                txn.put(k, encode_entry(rec), db=self._dbs["blocks"])
                txn.put(k, b"", db=self._dbs["pending"])
                out.append(True)
            return out

        return self._run_write(go)

    def commit(self, tier: str, keys: Iterable[str]) -> int:
        """PENDING -> READY for `keys`; returns how many were committed."""
        tid = self.tier_id(tier)

        def go(txn: lmdb.Transaction) -> int:
            n = nbytes = 0
            for key in keys:
                k = self._k(key, tid)
                raw = txn.get(k, db=self._dbs["blocks"])
                if raw is None:
                    continue
                e = decode_entry(raw, key, tier)
                if e.state != PENDING:
                    continue
                txn.put(k, encode_entry(e.replace(state=READY, owner_pid=0)),
                        db=self._dbs["blocks"])
                txn.delete(k, db=self._dbs["pending"])
                n, nbytes = n + 1, nbytes + e.size
            self._bump(txn, tid, n, nbytes)
            return n

        return self._run_write(go)

    def abort(self, tier: str, keys: Iterable[str]) -> list[Entry]:
        """Drop PENDING entries for `keys` (READY ones stay); returns those dropped."""
        return self._remove(tier, keys, only_state=PENDING)

    def delete(self, tier: str, keys: Iterable[str]) -> list[Entry]:
        """Drop entries of `keys` in any state; returns what was removed.

        Callers free the bytes only after this returns (the transaction has committed).
        """
        return self._remove(tier, keys, only_state=None)

    def _remove(self, tier: str, keys: Iterable[str], only_state: int | None) -> list[Entry]:
        tid = self.tier_id(tier)

        def go(txn: lmdb.Transaction) -> list[Entry]:
            gone, nbytes = [], 0
            for key in keys:
                k = self._k(key, tid)
                raw = txn.get(k, db=self._dbs["blocks"])
                if raw is None:
                    continue
                e = decode_entry(raw, key, tier)
                if only_state is not None and e.state != only_state:
                    continue
                txn.delete(k, db=self._dbs["blocks"])
                txn.delete(k, db=self._dbs["pending"])
                if e.state == READY:
                    nbytes += e.size
                gone.append(e)
            ready = sum(1 for e in gone if e.state == READY)
            self._bump(txn, tid, -ready, -nbytes)
            return gone

        return self._run_write(go)

    def recover(self) -> list[Entry]:
        """Remove PENDING entries whose owner process is gone; return them."""
        names = self.tier_names()
        with self._txn(write=False) as txn:
            stale = []
            for k, _ in txn.cursor(db=self._dbs["pending"]):
                raw = txn.get(k, db=self._dbs["blocks"])
                if raw is None:
                    stale.append((k, None))
                    continue
                e = decode_entry(raw, k[:24].hex(), names.get(k[24], "?"))
                if not owner_alive(e.owner_pid, e.created):
                    stale.append((k, e))
        if not stale:
            return []

        def go(txn: lmdb.Transaction) -> list[Entry]:
            out = []
            for k, e in stale:
                txn.delete(k, db=self._dbs["pending"])
                raw = txn.get(k, db=self._dbs["blocks"])
                if e is not None and raw is not None and decode_entry(raw).state == PENDING:
                    txn.delete(k, db=self._dbs["blocks"])
                    out.append(e)
            return out

        return self._run_write(go)

    # ---- reads ------------------------------------------------------------------------

    def get(self, tier: str, keys: Sequence[str], ready_only: bool = True) -> list[Entry | None]:
        """The entry of each key in `tier` (None where absent, or PENDING and `ready_only`)."""
        tid = self.tier_id(tier)
        out: list[Entry | None] = []
        with self._txn(write=False) as txn:
            for key in keys:
                raw = txn.get(self._k(key, tid), db=self._dbs["blocks"])
                e = decode_entry(raw, key, tier) if raw is not None else None
                out.append(None if e is None or (ready_only and e.state != READY) else e)
        return out

    def locate(self, keys: Sequence[str]) -> list[dict[str, Entry]]:
        """For each key, its READY copies by tier name, in one read transaction."""
        names = self.tier_names()
        out = []
        with self._txn(write=False) as txn:
            cur = txn.cursor(db=self._dbs["blocks"])
            for key in keys:
                kb, found = key_bytes(key), {}
                if cur.set_range(kb):
                    for k, raw in cur:
                        if k[:24] != kb:
                            break
                        e = decode_entry(raw, key, names.get(k[24], "?"))
                        if e.state == READY:
                            found[e.tier] = e
                out.append(found)
        return out

    def scan(self, tier: str | None = None, states: tuple[int, ...] = (READY, PENDING)
             ) -> Iterator[Entry]:
        """Every entry (of one tier), in key order. Holds a read transaction while iterating."""
        names = self.tier_names()
        tid = self.tier_id(tier) if tier is not None else None
        with self._txn(write=False) as txn:
            for k, raw in txn.cursor(db=self._dbs["blocks"]):
                if tid is not None and k[24] != tid:
                    continue
                e = decode_entry(raw, k[:24].hex(), names.get(k[24], "?"))
                if e.state in states:
                    yield e

    def touch(self, tier: str, keys: Sequence[str], when: float | None = None) -> None:
        """Record an access (batched by callers; a write transaction per call)."""
        tid, when = self.tier_id(tier), when or time.time()

        def go(txn: lmdb.Transaction) -> None:
            for key in keys:
                k = self._k(key, tid)
                raw = txn.get(k, db=self._dbs["blocks"])
                if raw is not None:
                    txn.put(k, encode_entry(decode_entry(raw, key, tier).replace(
                        last_access=when)), db=self._dbs["blocks"])

        self._run_write(go)

    def tier_usage(self, tier: str) -> tuple[int, int]:
        """(READY blocks, READY bytes) of `tier`, kept exactly by every commit and delete."""
        with self._txn(write=False) as txn:
            raw = txn.get(bytes([self.tier_id(tier)]), db=self._dbs["tierstats"])
        if raw is None:
            return 0, 0
        n, b = raw.decode().split(",")
        return int(n), int(b)

    def pending_count(self) -> int:
        with self._txn(write=False) as txn:
            return txn.stat(self._dbs["pending"])["entries"]

    def ready_pages(self, tier: str, limit: int = 16384) -> Iterator[list[Entry]]:
        """This node's READY entries of `tier`, a page at a time, each page read in its own
        transaction (a read transaction held for a whole scan would keep LMDB from reusing
        pages while writers commit)."""
        self.tier_id(tier)  # allocated (if need be) before any transaction of ours
        after: bytes | None = b""
        while after is not None:
            with self.read() as txn:
                page, after = txn.ready_page(tier, after, limit)
            yield page

    def health(self) -> dict[str, int]:
        """Dead-writer leftovers, sessions and how full the LMDB map is, in bytes."""
        with self._txn(write=False) as txn:
            pending = txn.stat(self._dbs["pending"])["entries"]
            sessions = txn.stat(self._dbs["sessions"])["entries"]
        info, stat = self._env.info(), self._env.stat()
        return {"pending": pending, "sessions": sessions, "map_size_bytes": self._map_size,
                "map_used_bytes": (info["last_pgno"] + 1) * stat["psize"],
                "max_map_size_bytes": self.max_map_size_bytes}

    # ---- the usage counters against the entries (`kvtier inspect check`) ---------------

    def usage_audit(self) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
        """(READY blocks, bytes) per tier counted from the entries, and as the usage counters
        record them, in one read transaction: a commit updates both in one transaction, so
        a writer meanwhile never makes them look different."""
        with self._txn(write=False) as txn:
            counted, recorded = self._usage(txn)
        names = self.tier_names()
        return ({names.get(t, f"#{t}"): v for t, v in counted.items()},
                {names.get(t, f"#{t}"): v for t, v in recorded.items()})

    def rewrite_usage(self) -> int:
        """Rewrite every tier's usage counters from its entries, in one write transaction
        (exact beside running writers); return how many changed."""

        def go(txn: lmdb.Transaction) -> int:
            counted, recorded = self._usage(txn)
            changed = 0
            for tid in set(counted) | set(recorded):
                want = counted.get(tid, (0, 0))
                if recorded.get(tid, (0, 0)) != want:
                    txn.put(bytes([tid]), f"{want[0]},{want[1]}".encode(),
                            db=self._dbs["tierstats"])
                    changed += 1
            return changed

        return self._run_write(go)

    def _usage(self, txn: lmdb.Transaction):
        counted: dict[int, tuple[int, int]] = {}
        for k, raw in txn.cursor(db=self._dbs["blocks"]):
            e = decode_entry(raw)
            if e.state == READY:
                n, b = counted.get(k[24], (0, 0))
                counted[k[24]] = (n + 1, b + e.size)
        recorded = {}
        for k, raw in txn.cursor(db=self._dbs["tierstats"]):
            n, b = bytes(raw).decode().split(",")
            recorded[k[0]] = (int(n), int(b))
        return counted, recorded

    def _bump(self, txn: lmdb.Transaction, tid: int, n: int, nbytes: int) -> None:
        if not n and not nbytes:
            return
        k = bytes([tid])
        raw = txn.get(k, db=self._dbs["tierstats"])
        cn, cb = (map(int, raw.decode().split(","))) if raw else (0, 0)
        txn.put(k, f"{cn + n},{cb + nbytes}".encode(), db=self._dbs["tierstats"])

    def _k(self, key: str, tier: str | int) -> bytes:
        tid = tier if isinstance(tier, int) else self.tier_id(tier)
        return key_bytes(key) + bytes([tid])
