"""Identity across processes and instances: what names a block must not depend on anything
that differs between instances, and a mismatch that would turn into silent misses is an error
at start instead.

- `PYTHONHASHSEED` (fixed, different, or missing): every key, fingerprint, connector key and
  request salt is byte-identical across processes (blake2b over fixed-width ids, never the
  salted `hash()`); nothing in kvtier calls `hash()`, and the connector never keys blocks by
  vLLM's `request.block_hashes` (which do depend on the seed).
- A policy whose namespace (model, tenant) or chunk size does not match an existing index is
  refused at open with one line naming both and the fix.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fault_util import HERE, make, policy_dict
from kvtier.store.base.errors import IndexError_
from kvtier.store.tiered import TieredStore

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("store", "tiers", "connector", "eviction", "tools")


def probe(tmp_path: Path, seed: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    out = subprocess.run([sys.executable, str(HERE / "hash_probe.py"), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_keys_do_not_depend_on_pythonhashseed(tmp_path):
    runs = {seed: probe(tmp_path, seed) for seed in ("0", "4242", None)}
    hashes = {r.pop("builtin_hash") for r in runs.values()}
    assert len(hashes) >= 2, "the seeds did not take effect: the test proves nothing"
    first = runs["0"]
    assert first["keys"] and first["connector"] and first["salted"] != first["keys"]
    for seed, got in runs.items():
        assert got == first, f"PYTHONHASHSEED={seed} changed a name"


def calls(pred) -> list[str]:
    found = []
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if pred(node):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_nothing_calls_the_salted_builtin_hash():
    assert not calls(lambda n: isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                     and n.func.id == "hash")


def test_the_connector_never_keys_by_vllm_block_hashes():
    found = [f for f in calls(lambda n: isinstance(n, ast.Attribute)
                              and n.attr in ("block_hashes", "get_hash_value"))
             if f.startswith("connector/")]
    assert not found, found


@pytest.mark.parametrize("change, field", [
    ({"namespace": {"model": "other-model"}}, "namespace"),
    ({"namespace": {"model": "kvtier-faults", "tenant": "acme"}}, "namespace"),
    ({"chunk_tokens": 32}, "chunk_tokens"),
])
def test_a_policy_that_does_not_match_the_index_is_refused(tmp_path, change, field):
    TieredStore(make(policy_dict(tmp_path)), mover=False).close()
    with pytest.raises(IndexError_) as err:
        TieredStore(make(policy_dict(tmp_path, **change)), mover=False)
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path / "index") in msg and field in msg, msg
    assert "index.path" in msg  # the fix: another index, or the policy that matches
