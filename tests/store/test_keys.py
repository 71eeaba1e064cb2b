"""Keys are deterministic across processes and hash seeds, and separate namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvtier.store.base.keys import (KEY_HEX, Namespace, block_keys, check_key, chunk_hashes,
                               end_key, end_keys, id_chain_hashes, is_key, key_namespace)

SCRIPT = """
import json, sys
from kvtier.store.base.keys import Namespace, block_keys, id_chain_hashes
ns = Namespace(model="m", dtype="bfloat16", tp_rank=1, tp_size=2, chunk_tokens=16)
toks = list(range(1000, 1100))
print(json.dumps({"keys": block_keys(ns, toks, salt=b"lora-a"),
                  "ids": [h.hex() for h in id_chain_hashes([5, "x", 7])]}))
"""


def run_with_seed(seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_keys_are_the_same_in_processes_with_different_hash_seeds():
    a, b = run_with_seed("1"), run_with_seed("987654")
    assert a["keys"] == b["keys"] and len(a["keys"]) == 6
    assert a["ids"] == b["ids"]
    ns = Namespace(model="m", dtype="bfloat16", tp_rank=1, tp_size=2, chunk_tokens=16)
    assert block_keys(ns, list(range(1000, 1100)), salt=b"lora-a") == a["keys"]


def test_chain_is_a_prefix_chain():
    toks = np.arange(64, dtype=np.int64)
    full = chunk_hashes(toks, 16)
    assert chunk_hashes(toks[:48], 16) == full[:3]
    changed = toks.copy()
    changed[20] += 1  # a change in chunk 1 changes chunk 1 and every chunk after it
    other = chunk_hashes(changed, 16)
    assert other[0] == full[0] and all(x != y for x, y in zip(other[1:], full[1:]))
    assert len(chunk_hashes(toks[:47], 16)) == 2  # a partial tail has no key


def test_a_chain_extended_later_equals_the_chain_computed_at_once():
    ns = Namespace(model="m", chunk_tokens=16)
    toks = list(range(500, 600))
    full = block_keys(ns, toks, salt=b"s")
    head = block_keys(ns, toks[:32], salt=b"s")
    assert head + block_keys(ns, toks[32:], salt=b"s", after=head[-1]) == full
    assert block_keys(ns, toks[32:], after=head[-1]) == full[2:]  # the salt is in the chain
    with pytest.raises(ValueError, match="not a kvtier block key"):
        block_keys(ns, toks, after="nope")


def test_end_keys_name_every_position_inside_the_next_chunk_and_never_a_chunk():
    ns = Namespace(model="m", chunk_tokens=16)
    fp = ns.fingerprint()
    toks = list(range(700, 740))
    chunks = block_keys(ns, toks, salt=b"s")
    ends = end_keys(fp, toks[32:40], b"s", after=chunks[1])
    assert len(ends) == 9 and len(set(ends)) == 9 and not set(ends) & set(chunks)
    assert all(is_key(k) and key_namespace(k) == fp for k in ends)
    # each end depends on the chain before it and on exactly the tokens up to it
    assert end_keys(fp, toks[32:35], b"s", after=chunks[1]) == ends[:4]
    assert end_keys(fp, toks[32:40], b"s", after=chunks[0])[5] != ends[5]
    changed = toks[32:40]
    changed[3] += 1
    moved = end_keys(fp, changed, b"s", after=chunks[1])
    assert moved[:4] == ends[:4] and all(a != b for a, b in zip(moved[4:], ends[4:]))
    # at the start: the salt separates, as for chunks
    assert end_keys(fp, toks[:3], b"s")[1:] != end_keys(fp, toks[:3], b"t")[1:]
    # `end_key`: the end after a whole sequence, its chain computed from its tokens
    assert end_key(fp, toks[:37], 16, b"s") == ends[5]
    assert end_key(fp, toks[:32], 16, b"s") == ends[0]
    assert end_key(fp, toks[:3], 16, b"s") == end_keys(fp, toks[:3], b"s")[-1]


@pytest.mark.parametrize("field,value", [("model", "other"), ("dtype", "float16"),
                                         ("layout", "NHD"), ("block_size", 32),
                                         ("chunk_tokens", 32), ("tp_rank", 1), ("tp_size", 4),
                                         ("pp_rank", 1), ("pp_size", 2), ("tenant", "b")])
def test_every_namespace_field_changes_the_fingerprint(field, value):
    base = Namespace(model="m")
    other = Namespace(**{**base.__dict__, field: value})
    assert base.fingerprint() != other.fingerprint()
    toks = list(range(64))
    assert set(block_keys(base, toks)).isdisjoint(block_keys(other, toks))


def test_salt_separates_and_keys_are_hex():
    ns = Namespace(model="m", chunk_tokens=16)
    plain, salted = block_keys(ns, range(32)), block_keys(ns, range(32), salt=b"s")
    assert set(plain).isdisjoint(salted)
    for key in plain:
        assert is_key(key) and len(key) == KEY_HEX and key_namespace(key) == ns.fingerprint()


@pytest.mark.parametrize("bad", ["", "../../etc/passwd", "A" * 48, "g" * 48, "a" * 47, None, 7,
                                 "a" * 46 + "/x"])
def test_malformed_keys_are_refused(bad):
    assert not is_key(bad)
    with pytest.raises(ValueError, match="not a kvtier block key"):
        check_key(bad)
