"""A sliding-window model (a tiny Gemma 3 shape: one sliding-window layer beside one
full-attention layer) on real vLLM CPU engines with kvtier.

kvtier does not implement vLLM's hybrid memory allocator (`SupportsHMA`), so vLLM turns it
off and keeps one KV cache group: the sliding-window layer's KV is kept (and stored by
kvtier) for every token, like a full-attention layer's. Hits are then exact; what a
window-aware store would save is measured in BENCHMARKS.md. Two engine processes on one
kvtier cluster; slow (two engine starts), run with `--runslow`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_util import (  # noqa: E402  (tests/connector is on sys.path)
    cluster, BLOCK_SIZE, CHUNK, tiny_engines, random_prompt)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TOKENS = 16
LONG = 3000
MODEL = "tiny-swa"


@pytest.fixture(scope="module")
def engines(cluster, tmp_path_factory):
    pool = tiny_engines(tmp_path_factory, MODEL, "swa")
    yield pool
    pool.close()


def node(engines, cluster, name):
    tc = cluster.transfer_config(name, namespace={"model": MODEL})
    return engines.get(name, tc, block_size=BLOCK_SIZE["swa"])


def test_a_sliding_window_model_hits_from_the_pool_on_another_instance(engines, cluster):
    prompt = random_prompt(1, LONG)
    a = node(engines, cluster, "a")
    cold, _ = a.generate([prompt], TOKENS)
    assert cold[0].num_cached_tokens == 0 and len(set(cold[0].token_ids)) > 1
    b = node(engines, cluster, "b")
    hit, _ = b.generate([prompt], TOKENS)
    hits = hit[0].kv_transfer_params["kvtier"]["hit_tokens"]
    assert hits == {"dram": hit[0].num_cached_tokens}
    assert hit[0].num_cached_tokens >= 0.9 * LONG and hits["dram"] % CHUNK == 0
    assert hit[0].token_ids == cold[0].token_ids
    log = b.log_path.read_text(errors="replace")
    assert "Hybrid KV cache manager is disabled" in log  # one group: all layers, all tokens
