"""A sliding-window model (a tiny Gemma 3 shape: one sliding-window layer beside one
full-attention layer) on real vLLM CPU engines with kvtier.

kvtier implements vLLM's hybrid memory allocator (`SupportsHMA`), so vLLM keeps it on: two
KV cache groups with their own block ids, the sliding-window layer's blocks below its window
freed as vLLM frees them without a connector. kvtier stores every chunk of the full group
and of the sliding-window group only the chunks a window reaches from the prompt's end on.
Two engine processes on one kvtier cluster, and one without kvtier for the reference output.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_util import (  # noqa: E402  (tests/connector is on sys.path)
    cluster, BLOCK_SIZE, CHUNK, chunk_keys, tiny_engines, random_prompt, wait_for)
from kvtier.connector.naming import rank_keys  # noqa: E402
from kvtier.tools.vllm_engine import logged_namespaces  # noqa: E402

pytestmark = pytest.mark.vllm
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


def group_namespaces(log: str) -> dict[str, str]:
    """{kind: namespace fingerprint} of each KV cache group, from the worker's start line."""
    return {kind: fps[0] for kind, fps in logged_namespaces(log).items()}


def stored(cluster, keys: list[str]) -> int:
    """How many of `keys` the cluster holds, in any tier."""
    with cluster.probe() as store:
        return sum(store.lookup([k], observe=False).hit_blocks for k in keys)


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
    assert hit[0].token_ids == cold[0].token_ids == engines.baseline(prompt, TOKENS).token_ids
    log = b.log_path.read_text(errors="replace")
    assert "Turning off hybrid kv cache manager" not in log
    spaces = group_namespaces(log)
    assert set(spaces) == {"swa", "full"}, log[-3000:]
    # every chunk of the full-attention layer; of the sliding-window layer (a 128-token
    # window) the chunks from the prompt's end back to where a window can reach
    keys = chunk_keys(prompt, cluster.policy("a", namespace={"model": MODEL}), "swa")
    assert keys[0].startswith(spaces["full"])  # the replay's and bench's keys are these
    n_full = stored(cluster, rank_keys(keys, spaces["full"]))
    n_swa = stored(cluster, rank_keys(keys, spaces["swa"]))
    reach = LONG - CHUNK - 127
    assert n_full == len(keys) == LONG // CHUNK
    assert n_swa == sum((c + 1) * CHUNK > reach for c in range(len(keys)))
    assert n_swa <= 4


def test_prompts_forking_after_a_shared_prefix_hit_from_the_second_fork_on(engines, cluster):
    """Sessions that share a long system prompt and then differ: the first fork finds the
    full layer's chunks but no window at the fork and recomputes, storing that window; the
    next fork, on an engine that never saw the prefix, loads it, token-identical."""
    shared = random_prompt(2, 2000)
    first = shared + random_prompt(3, 600)
    a = node(engines, cluster, "a")
    a.generate([first], TOKENS)
    b = node(engines, cluster, "b")
    b.reset_prefix_cache()
    fork, _ = b.generate([shared + random_prompt(4, 600)], TOKENS)
    assert fork[0].kv_transfer_params["kvtier"]["hit_tokens"] == {}
    end = len(shared) // CHUNK  # the last chunk all three prompts share
    keys = chunk_keys(shared, cluster.policy("b", namespace={"model": MODEL}), "swa")
    window = rank_keys(keys[(end * CHUNK - 127) // CHUNK:end],
                       group_namespaces(b.log_path.read_text(errors="replace"))["swa"])
    wait_for(lambda: stored(cluster, window) == len(window), 60, "the fork's window saved")
    a.reset_prefix_cache()
    prompt = shared + random_prompt(5, 600)
    hit, _ = a.generate([prompt], TOKENS)
    hits = hit[0].kv_transfer_params["kvtier"]["hit_tokens"]
    assert hits == {"dram": end * CHUNK}, hits
    assert hit[0].token_ids == engines.baseline(prompt, TOKENS).token_ids
