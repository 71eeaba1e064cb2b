"""Sessions as the index keeps them: a record and a manifest (the chain of block keys).

`TieredStore` writes a session when one of its turns ends and deletes it when the session
ends, so `kvtier inspect sessions` and `inspect gc` work offline and beside running
instances: a block no stored manifest holds is referenced by no live session on this node.
Value layout: a JSON line (the record), then the 24-byte keys of the chain back to back.

Session ids are the same wherever a session is seen (`SessionTracker`), so two processes of
a node may write one session: a write keeps the keys of the manifest already stored that
the new chain lacks (after it), so no process's write makes another's live blocks look
unreferenced to `gc`; the record is the last writer's.
"""

from __future__ import annotations

import json
from typing import Iterable, Iterator, Sequence

from kvtier.store.base.index import Index
from kvtier.store.base.keys import key_bytes

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
