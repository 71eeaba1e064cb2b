"""The age queue of the sharedfs tier: this node's stored blocks, oldest first, in LMDB.

One table per tier (`sharedfs.<tier>`), rows `b"A" + created ns (8 bytes, big endian) + key`
-> frame bytes, so a cursor from `b"A"` walks this node's blocks from the oldest. Rows are
added after a commit and removed with the entry; a row whose entry has gone (or was written
again, with a new creation time) is stale and simply skipped when popped.
"""

from __future__ import annotations

import struct
from typing import Sequence

from kvtier.store.base.index import Index
from kvtier.store.base.index_record import Entry
from kvtier.store.base.keys import key_bytes

_U64 = struct.Struct(">Q")


class AgeQueue:
    def __init__(self, index: Index, tier: str):
        self.index, self.tier = index, tier
        self.table = f"sharedfs.{tier}"
        # Now, outside any transaction: opening a table takes LMDB's write lock.
        index.open_table(self.table)

    def add(self, entries: Sequence[Entry]) -> None:
        self._rows(entries, add=True)

    def remove(self, entries: Sequence[Entry]) -> None:
        self._rows(entries, add=False)

    def pop_oldest(self, nbytes: int) -> list[tuple[int, str]]:
        """Take the oldest rows that add up to `nbytes`; (created ns, key) each."""
        def go(txn):
            taken, got = [], 0
            for k, v in txn.rows(self.table, prefix=b"A"):
                if got >= nbytes:
                    break
                taken.append(k)
                got += _U64.unpack(v)[0]
            for k in taken:
                txn.delete(self.table, k)
            return [(_U64.unpack(k[1:9])[0], k[9:].hex()) for k in taken]
        return self.index.run_write(go)

    def _rows(self, entries: Sequence[Entry], add: bool) -> None:
        if not entries:
            return
        def go(txn):
            for e in entries:
                k = b"A" + _U64.pack(created_ns(e)) + key_bytes(e.key)
                if add:
                    txn.put(self.table, k, _U64.pack(e.size))
                else:
                    txn.delete(self.table, k)
        self.index.run_write(go)


def created_ns(e: Entry) -> int:
    return int(e.created * 1e9)
