"""The age queue of the sharedfs tier: this node's stored blocks, oldest first, in LMDB.

One table per tier (`sharedfs.<tier>`), rows `b"A" + created ns (8 bytes, big endian) + key`
-> frame bytes, so a cursor from `b"A"` walks this node's blocks from the oldest. Rows are
added after a commit and removed with the entry; a row whose entry has gone (or was written
again, with a new creation time) is stale and simply skipped when popped.
"""

from __future__ import annotations

import struct
from typing import Sequence

from kvtier.store.index import Index
from kvtier.store.index_record import Entry
from kvtier.store.keys import key_bytes

_U64 = struct.Struct(">Q")


class AgeQueue:
    def __init__(self, index: Index, tier: str):
        self.index, self.tier = index, tier
        self._table()  # open it now: opening it later would race with concurrent writers

    def _table(self):
        # Looked up outside transactions and at every call: the index reopens its
        # environment after a fork, and opening a table inside a write transaction deadlocks.
        return self.index.table(f"sharedfs.{self.tier}")

    def add(self, entries: Sequence[Entry]) -> None:
        self._rows(entries, add=True)

    def remove(self, entries: Sequence[Entry]) -> None:
        self._rows(entries, add=False)

    def pop_oldest(self, nbytes: int) -> list[tuple[int, str]]:
        """Take the oldest rows that add up to `nbytes`; (created ns, key) each."""
        db = self._table()

        def go(txn):
            cur, out, got = txn.cursor(db=db), [], 0
            while got < nbytes and cur.set_range(b"A") and cur.key()[:1] == b"A":
                k = cur.key()
                out.append((_U64.unpack(k[1:9])[0], k[9:].hex()))
                got += _U64.unpack(cur.value())[0]
                cur.delete()
            return out
        return self.index.run_write(go)

    def _rows(self, entries: Sequence[Entry], add: bool) -> None:
        if not entries:
            return
        db = self._table()

        def go(txn):
            for e in entries:
                k = b"A" + _U64.pack(created_ns(e)) + key_bytes(e.key)
                if add:
                    txn.put(k, _U64.pack(e.size), db=db)
                else:
                    txn.delete(k, db=db)
        self.index.run_write(go)


def created_ns(e: Entry) -> int:
    return int(e.created * 1e9)
