"""An MLA model (a tiny DeepSeek-V2 shape) on real vLLM CPU engines with kvtier.

vLLM's CPU build runs MLA on `CPU_MLA` and turns its own prefix caching off there, so kvtier
is the only prefix cache these engines have. Two engine processes (`a`, `b`) on one kvtier
cluster; `a`'s first answer is the cold one (nothing stored yet), and every later answer,
from either instance, must match it token for token.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_util import (  # noqa: E402  (tests/connector is on sys.path)
    cluster, BLOCK_SIZE, CHUNK, tiny_engines, chunk_keys, files_of,
    random_prompt, wait_for)

from kvtier.store.base import block  # noqa: E402
from kvtier.tools.vllm_engine import ENGINE_ARGS, TINY_MLA  # noqa: E402

pytestmark = pytest.mark.vllm
TOKENS = 16
LONG = 3000
BS = BLOCK_SIZE["mla"]
MODEL = "tiny-mla"


@pytest.fixture(scope="module")
def engines(cluster, tmp_path_factory):
    pool = tiny_engines(tmp_path_factory, MODEL, "mla")
    yield pool
    pool.close()


def policy(cluster, name):
    return cluster.policy(name, namespace={"model": MODEL})


def node(engines, cluster, name):
    tc = cluster.transfer_config(name, namespace={"model": MODEL})
    return engines.get(name, tc, block_size=BS, engine_args=ENGINE_ARGS["mla"])


def served(engine, prompt):
    outs, _ = engine.generate([prompt], TOKENS)
    return outs[0]


def test_a_long_prompt_hits_from_the_pool_on_another_instance(engines, cluster):
    prompt = random_prompt(1, LONG)
    a = node(engines, cluster, "a")
    cold = served(a, prompt)
    assert cold.num_cached_tokens == 0
    full_chunks = (LONG - 1) // CHUNK
    assert cold.kv_transfer_params["kvtier"]["saved_chunks"] >= full_chunks
    b = node(engines, cluster, "b")
    hit = served(b, prompt)
    hits = hit.kv_transfer_params["kvtier"]["hit_tokens"]
    assert hits == {"dram": hit.num_cached_tokens}
    assert hit.num_cached_tokens >= 0.9 * LONG
    assert hit.token_ids == cold.token_ids
    # vLLM keeps no prefix cache of its own here: a's second turn also comes from kvtier
    again = served(a, prompt + random_prompt(2, 200))
    assert sum(again.kv_transfer_params["kvtier"]["hit_tokens"].values()) >= full_chunks * CHUNK


def test_the_stored_chunk_is_the_latent_cache(engines, cluster):
    """Each chunk is `chunk / block` blocks x layers x one 576-wide latent per token, in
    the MLA namespace (not what a full-attention model of the same name would use)."""
    prompt = random_prompt(1, LONG)
    keys = chunk_keys(prompt, policy(cluster, "a"), "mla")[:(LONG - 1) // CHUNK]
    llama_keys = chunk_keys(prompt, policy(cluster, "a"), "llama")[:len(keys)]
    assert {k[:16] for k in keys}.isdisjoint(k[:16] for k in llama_keys)
    keys = keys[:3]
    # the mover persists at the least CPU priority: on a host busy with other tests, slowly
    wait_for(lambda: len(files_of(cluster.shared, keys)) == len(keys), 180,
             "the mover to persist the first chunks to sharedfs")
    latent = TINY_MLA["kv_lora_rank"] + TINY_MLA["qk_rope_head_dim"]
    payload = CHUNK * TINY_MLA["num_hidden_layers"] * latent * 4  # float32
    for key, path in zip(keys, files_of(cluster.shared, keys)):
        assert block.verify(path.read_bytes(), key).payload_len == payload


@pytest.mark.slow
def test_tensor_parallel_ranks_read_the_one_copy_any_engine_stored(engines, cluster):
    """MLA's latent is the same on every TP rank: a TP=2 engine (two worker processes, one
    core each) hits the chunks the TP=1 engine `a` stored, on both ranks, and the chunks
    it stores itself carry the same keys as a TP=1 engine's (stored once, not per rank)."""
    tc = cluster.transfer_config("t", namespace={"model": MODEL})
    tp2 = engines.get("t", tc, block_size=BS, inproc=False,
                      engine_args={**ENGINE_ARGS["mla"], "tensor_parallel_size": 2},
                      env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    prompt = random_prompt(1, LONG)  # a stored it in the first test
    ref = served(node(engines, cluster, "a"), prompt)  # = a's cold tokens (first test)
    hit = served(tp2, prompt)
    assert hit.kv_transfer_params["kvtier"]["hit_tokens"] == {"dram": hit.num_cached_tokens}
    assert hit.num_cached_tokens >= 0.9 * LONG and hit.token_ids == ref.token_ids
    fresh = random_prompt(3, 1000)
    first = served(tp2, fresh)
    assert first.kv_transfer_params["kvtier"]["saved_chunks"] == (len(fresh) - 1) // CHUNK
    keys = chunk_keys(fresh, policy(cluster, "t"), "mla")  # as a TP=1 engine names them
    wait_for(lambda: len(files_of(cluster.shared, keys)) == len(keys), 60,
             "the mover to persist the TP=2 engine's chunks under TP=1 keys")
    again = served(node(engines, cluster, "b"), fresh)
    assert again.num_cached_tokens >= 0.9 * len(fresh) and again.token_ids == first.token_ids
