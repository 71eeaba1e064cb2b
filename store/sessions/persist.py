"""Sessions as the index keeps them: a record and a manifest (the chain of block keys).

`TieredStore` writes a session when one of its turns ends and deletes it when the session
ends, so `kvtier inspect sessions` and `inspect gc` work offline and beside running
instances: a block no stored manifest holds is referenced by no live session on this node.
Value layout: a JSON line (the record), then the 24-byte keys of the chain back to back.

A request's end queues its session's row on a `RowWriter`, whose thread writes it: the
engine's thread must not wait on the index's write lock (another process of the node may
hold it) or on the commit's sync (~2-6 ms on a VM's disk, every request).

Session ids are the same wherever a session is seen (`SessionTracker`), so two processes of
a node may write one session: a write keeps the keys of the manifest already stored that
the new chain lacks (after it), so no process's write makes another's live blocks look
unreferenced to `gc`; the record is the last writer's.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Iterable, Iterator, Sequence

from kvtier.store.base.errors import IndexError_
from kvtier.store.base.index import Index
from kvtier.store.base.keys import key_bytes
from kvtier.store.base.repeats import thin

log = thin(logging.getLogger(__name__))
_KEY_BYTES = 24


def write_sessions(index: Index, sessions: Iterable[tuple[str, dict, Sequence[str]]]) -> None:
    """Store (id, record, chain) for each session, in one write transaction."""
    rows = [(str(sid).encode(), json.dumps(rec, sort_keys=True).encode() + b"\n",
             [key_bytes(k) for k in chain]) for sid, rec, chain in sessions]
    if not rows:
        return

    def go(txn) -> None:
        for sid, head, chain in rows:
            old = txn.get("sessions", sid)
            if old is not None:
                have = set(chain)
                tail = old.partition(b"\n")[2]
                chain = chain + [k for k in (tail[i:i + _KEY_BYTES]
                                             for i in range(0, len(tail), _KEY_BYTES))
                                 if k not in have]
            txn.put("sessions", sid, head + b"".join(chain))

    index.run_write(go)


class RowWriter:
    """Writes session rows on a thread of its own, in the order queued, as many as are
    waiting in one transaction. `flush()` returns once every row queued before it is in the
    index (or failed: a row is bookkeeping, its failure is logged and the next turn's end
    writes the session again)."""

    def __init__(self, index: Index):
        self.index = index
        self._closed = False
        self._fresh()

    def _fresh(self) -> None:
        """This process's lock, queue and thread (a forked child's own: the parent's thread
        is not in it, and the parent's lock may have been held at the fork)."""
        self._cond = threading.Condition()
        self._pid = os.getpid()
        self._rows: list[tuple[str, dict, Sequence[str]]] = []
        self._queued = self._done = 0   # rows ever queued, rows ever written or failed
        threading.Thread(target=self._run, name="kvtier-session-rows", daemon=True).start()

    def put(self, rows: Sequence[tuple[str, dict, Sequence[str]]]) -> None:
        """Queue (id, record, chain) rows, as `write_sessions` takes them."""
        if not rows:
            return
        if self._pid != os.getpid():
            self._fresh()
        with self._cond:
            if self._closed:
                raise IndexError_(f"session rows for the index at {self.index.path} after "
                                  "the store was closed")
            self._rows.extend(rows)
            self._queued += len(rows)
            self._cond.notify_all()

    def flush(self) -> None:
        if self._pid != os.getpid():
            return  # nothing queued in this process yet
        with self._cond:
            target = self._queued
            self._cond.wait_for(lambda: self._done >= target)

    def close(self) -> None:
        """Write what is queued and stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.flush()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._rows or self._closed)
                rows, self._rows = self._rows, []
            if not rows:
                return
            try:
                write_sessions(self.index, rows)
            except Exception:  # noqa: BLE001 - one by one: a bad row must not lose the rest
                for row in rows:
                    self._write_one(row)
            with self._cond:
                self._done += len(rows)
                self._cond.notify_all()

    def _write_one(self, row) -> None:
        try:
            write_sessions(self.index, [row])
        except Exception as e:  # noqa: BLE001 - the thread must outlive a bad write
            log.warning("kvtier: the row of session %s not written to the index at %s: %s",
                        row[0], self.index.path, e)


def delete_sessions(index: Index, sids: Iterable[str]) -> None:
    sids = [str(s).encode() for s in sids]
    if not sids:
        return

    def go(txn) -> None:
        for sid in sids:
            txn.delete("sessions", sid)

    index.run_write(go)


def read_sessions(index: Index) -> Iterator[tuple[str, dict, list[str]]]:
    """Every stored session as (id, record, chain of hex keys)."""
    with index.read() as txn:
        rows = list(txn.rows("sessions"))
    for sid, value in rows:
        head, _, tail = value.partition(b"\n")
        chain = [tail[i:i + _KEY_BYTES].hex() for i in range(0, len(tail), _KEY_BYTES)]
        yield sid.decode(), json.loads(head), chain


def referenced_keys(index: Index) -> set[str]:
    """Keys held by the manifest of at least one stored session."""
    out: set[str] = set()
    for _, _, chain in read_sessions(index):
        out.update(chain)
    return out
