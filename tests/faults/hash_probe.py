"""A child of the fault suite: prints every name kvtier derives from content, as JSON, so the
parent can compare runs under different `PYTHONHASHSEED`s.

Covers block keys (with and without a salt), namespace fingerprints, the connector's keys
for a prompt (namespace from the vLLM config and KV geometry) and its request salt (LoRA,
cache salt, multimodal inputs), and trace-replay keys over opaque block ids.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from kvtier.connector.naming import request_salt
from kvtier.store.base.keys import Namespace, block_keys, id_chain_hashes, make_keys
from kvtier.tools.vllm_engine import prompt_keys


def probe(root: str) -> dict:
    ns = Namespace(model="llama", dtype="bfloat16", tenant="acme", chunk_tokens=64)
    tokens = list(range(1000, 1000 + 64 * 5))
    policy = {"namespace": {"model": "tiny"}, "chunk_tokens": 64,
              "index": {"path": f"{root}/index"},
              "tiers": [{"name": "shared", "kind": "sharedfs", "path": f"{root}/shared",
                         "capacity": "64MiB"}]}
    request = SimpleNamespace(
        prompt_embeds=None, lora_request=SimpleNamespace(lora_name="adapter-1"),
        cache_salt="tenant-secret",
        mm_features=[SimpleNamespace(identifier="img-1", mm_position=SimpleNamespace(offset=7))])
    salt = request_salt(request)
    return {
        "fingerprints": [ns.fingerprint(), Namespace(model="llama").fingerprint()],
        "keys": block_keys(ns, tokens),
        "salted": block_keys(ns, tokens, salt),
        "salt": salt.hex(),
        "connector": prompt_keys(tokens, policy, "bfloat16", 32),
        "replay": make_keys(ns.fingerprint(), id_chain_hashes([3, "x", 99])),
        "builtin_hash": hash("kvtier"),  # differs between seeds: proves the seed took effect
    }


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])))
