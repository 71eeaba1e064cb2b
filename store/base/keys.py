"""Block keys: a namespace fingerprint plus a chained prefix hash per chunk of tokens.

A key is 48 lowercase hex characters: 16 for the namespace fingerprint, 32 for the chained
hash of the chunk and of every chunk before it. Equal keys mean equal token prefixes under
equal model, dtype, KV layout and parallel rank, on any machine and in any process: the hash
is blake2b over fixed-width little-endian token ids, never Python's salted `hash()`, so
`PYTHONHASHSEED` does not matter. Hex keys are safe as Mooncake keys and as file names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np

NS_HEX = 16
CHAIN_HEX = 32
KEY_HEX = NS_HEX + CHAIN_HEX
_CHAIN_BYTES = CHAIN_HEX // 2
_PERSON = b"kvtier-chain-v1"
_END_PERSON = b"kvtier-end-v1"
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a block. Two caches share blocks only if equal."""

    model: str
    dtype: str = "auto"
    layout: str = "auto"
    block_size: int = 16
    chunk_tokens: int = 256
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tenant: str = "default"

    def fingerprint(self) -> str:
        """16 hex characters that identify this namespace (stable across versions of Python)."""
        canon = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(canon, digest_size=NS_HEX // 2, person=b"kvtier-ns-v1").hexdigest()


def _root(salt: bytes) -> bytes:
    """The parent of a chain's first hash: the salt's."""
    return hashlib.blake2b(salt, digest_size=_CHAIN_BYTES, person=_PERSON).digest()


def chunk_hashes(tokens: Sequence[int] | np.ndarray, chunk_tokens: int,
                 salt: bytes = b"", parent: bytes | None = None) -> list[bytes]:
    """Chained 16-byte hashes, one per full chunk of `tokens`; a partial tail has none.

    `salt` separates prefixes that share tokens but not meaning (LoRA adapter, cache salt).
    `parent`: the hash of the chunk just before `tokens`, to extend a chain computed earlier
    (the salt is in it already).
    """
    arr = np.ascontiguousarray(np.asarray(tokens, dtype="<u4"))
    n_full = len(arr) // chunk_tokens
    if parent is None:
        parent = _root(salt)
    out: list[bytes] = []
    data = arr[: n_full * chunk_tokens].tobytes()
    step = chunk_tokens * 4
    for i in range(n_full):
        parent = hashlib.blake2b(parent + data[i * step:(i + 1) * step],
                                 digest_size=_CHAIN_BYTES, person=_PERSON).digest()
        out.append(parent)
    return out


def end_keys(ns_fingerprint: str, tokens: Sequence[int] | np.ndarray, salt: bytes = b"",
             after: str | None = None) -> list[str]:
    """Keys of the ends `after` + `tokens[:t]` for t = 0..len(tokens): one per token position
    a sequence can stop at inside the chunk that follows `after` (the key of the chunk just
    before, None at the start). A distinct family from the chunk keys (its own
    personalization: an end key never equals a chunk key), for what is stored at one exact
    position (a recurrent model's state there, and the part-chunk of KV before it)."""
    parent = _root(salt) if after is None else bytes.fromhex(check_key(after)[NS_HEX:])
    h = hashlib.blake2b(parent, digest_size=_CHAIN_BYTES, person=_END_PERSON)
    out = [ns_fingerprint + h.hexdigest()]
    data = np.ascontiguousarray(np.asarray(tokens, dtype="<u4")).tobytes()
    for i in range(0, len(data), 4):
        h.update(data[i:i + 4])
        out.append(ns_fingerprint + h.hexdigest())
    return out


def end_key(ns_fingerprint: str, tokens: Sequence[int] | np.ndarray, chunk_tokens: int,
            salt: bytes = b"") -> str:
    """The end key of the position right after all of `tokens` (`end_keys`, with the chain
    of their full chunks computed here)."""
    c = len(tokens) // chunk_tokens
    chain = chunk_hashes(tokens[:c * chunk_tokens], chunk_tokens, salt)
    after = ns_fingerprint + chain[-1].hex() if chain else None
    return end_keys(ns_fingerprint, tokens[c * chunk_tokens:], salt, after)[-1]


def id_chain_hashes(ids: Iterable[int | str], salt: bytes = b"") -> list[bytes]:
    """Chained hashes over opaque block ids (trace replay: the ids stand for chunks)."""
    parent = _root(salt)
    out = []
    for block_id in ids:
        parent = hashlib.blake2b(parent + str(block_id).encode(), digest_size=_CHAIN_BYTES,
                                 person=_PERSON).digest()
        out.append(parent)
    return out


def make_keys(ns_fingerprint: str, chain: Iterable[bytes]) -> list[str]:
    """Join a namespace fingerprint with chained hashes into hex keys."""
    return [ns_fingerprint + h.hex() for h in chain]


def block_keys(ns: Namespace, tokens: Sequence[int] | np.ndarray, salt: bytes = b"",
               after: str | None = None) -> list[str]:
    """The keys of every full chunk of `tokens` in namespace `ns`; `after`: the key of the
    chunk just before `tokens` (extends a chain: `block_keys(ns, t[:n]) + block_keys(ns,
    t[n:], after=<the last of those>)` equals `block_keys(ns, t)` for n a chunk multiple)."""
    parent = None if after is None else bytes.fromhex(check_key(after)[NS_HEX:])
    return make_keys(ns.fingerprint(), chunk_hashes(tokens, ns.chunk_tokens, salt, parent))


def is_key(key: object) -> bool:
    """True if `key` is a well-formed block key (48 lowercase hex characters)."""
    return isinstance(key, str) and len(key) == KEY_HEX and set(key) <= _HEX


def check_key(key: object) -> str:
    """Return `key` if it is well formed; raise ValueError otherwise (no path can escape)."""
    if not is_key(key):
        raise ValueError(f"not a kvtier block key (48 lowercase hex characters): {key!r}")
    return key  # type: ignore[return-value]


def check_keys(keys: Sequence[str]) -> None:
    """Raise ValueError naming the first item of `keys` that is not a block key. Checked in
    C over the joined batch (~30 us for 313 keys), cheap enough for every store call."""
    try:
        joined = "".join(keys)
        # equal lengths, lowercase, and hex with nothing skipped (fromhex skips whitespace)
        ok = (set(map(len, keys)) <= {KEY_HEX} and joined == joined.lower()
              and len(bytes.fromhex(joined)) * 2 == len(joined))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        check_key(next(k for k in keys if not is_key(k)))


def key_namespace(key: str) -> str:
    """The namespace fingerprint part of a key."""
    return key[:NS_HEX]


def key_bytes(key: str) -> bytes:
    """The 24 raw bytes of a key (index keys)."""
    return bytes.fromhex(key)
