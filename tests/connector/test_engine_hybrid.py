"""A recurrent hybrid (a tiny Granite 4.0-H shape: one Mamba2 layer beside one full-attention
layer) on real vLLM CPU engines with kvtier.

vLLM's CPU build runs such a model with its prefix caching off: kvtier is its prefix cache.
The Mamba layer's state is valid at one position only, so kvtier stores it where a step
ended computing a request (the end of each prefill step, and the request's end) with the
attention layer's part-chunk before that position; a hit restores chunks, part-chunk and
state together and ends exactly there. Two engine processes on one kvtier cluster, and
one without kvtier (prefix caching off as well) for the reference output.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_util import (  # noqa: E402  (tests/connector is on sys.path)
    cluster, BLOCK_SIZE, CHUNK, tiny_engines, random_prompt, wait_for)
from kvtier.connector.naming import rank_keys  # noqa: E402
from kvtier.store.base.keys import end_key  # noqa: E402
from kvtier.tools.vllm_engine import ENGINE_ARGS, logged_namespaces  # noqa: E402

pytestmark = pytest.mark.vllm
TOKENS = 16
LONG = 3000
MODEL = "tiny-hybrid"
ARGS = ENGINE_ARGS["hybrid"]


@pytest.fixture(scope="module")
def engines(cluster, tmp_path_factory):
    pool = tiny_engines(tmp_path_factory, MODEL, "hybrid", baseline_args=ARGS)
    yield pool
    pool.close()


def node(engines, cluster, name):
    tc = cluster.transfer_config(name, namespace={"model": MODEL})
    return engines.get(name, tc, block_size=BLOCK_SIZE["hybrid"], engine_args=ARGS)


def served(engine, prompt):
    outs, _ = engine.generate([prompt], TOKENS)
    return outs[0]


def end_stored(cluster, engine, tokens: list[int]) -> bool:
    """Whether the cluster holds the state and part-chunk a hit ending after `tokens` needs
    (named by the namespaces `engine`'s connector logged at start)."""
    spaces = logged_namespaces(engine.log_path.read_text(errors="replace"))
    key = end_key(spaces["full"][0], tokens, CHUNK)
    keys = [rank_keys([key], fp)[0] for fp in spaces["state"]]
    keys += [key] if len(tokens) % CHUNK else []
    with cluster.probe() as store:
        return all(store.where(keys))


def test_the_next_turn_restores_state_and_kv_from_the_pool_on_another_instance(engines,
                                                                               cluster):
    prompt = random_prompt(1, LONG)
    a = node(engines, cluster, "a")
    cold = served(a, prompt)
    assert cold.num_cached_tokens == 0 and len(set(cold.token_ids)) > 1
    assert set(logged_namespaces(a.log_path.read_text(errors="replace"))) == {"state", "full"}
    # the next turn: the prompt, a's answer and a new message, on an engine that never
    # saw it; the state stored at a's end (all but a's last token, which a never computed)
    turn = prompt + cold.token_ids + random_prompt(2, 200)
    b = node(engines, cluster, "b")
    hit = served(b, turn)
    params = hit.kv_transfer_params["kvtier"]
    assert params["hit_tokens"] == {"dram": hit.num_cached_tokens}
    assert hit.num_cached_tokens == LONG + TOKENS - 1 >= 0.9 * len(turn)
    assert params["recomputed_tokens"] == 0
    assert hit.token_ids == engines.baseline(turn, TOKENS).token_ids


def test_a_prompt_forking_at_a_stored_prompt_end_hits_there(engines, cluster):
    """Another continuation of a prompt (a retried tool call, an edited answer) hits at the
    prompt's end, stored when the prompt's prefill ended; one that forks inside a chunk
    with no state stored at the fork recomputes, with the right answer."""
    prompt = random_prompt(3, 2000)
    a = node(engines, cluster, "a")
    served(a, prompt)
    wait_for(lambda: end_stored(cluster, a, prompt), 60, "the prompt's end stored")
    b = node(engines, cluster, "b")
    fork = prompt + random_prompt(4, 150)
    hit = served(b, fork)
    assert hit.kv_transfer_params["kvtier"]["hit_tokens"] == {"dram": len(prompt)}
    assert hit.token_ids == engines.baseline(fork, TOKENS).token_ids
    inside = prompt[:len(prompt) - CHUNK // 2 - 7] + random_prompt(5, 300)
    miss = served(b, inside)
    assert miss.num_cached_tokens == 0
    assert miss.kv_transfer_params["kvtier"]["hit_tokens"] == {}
    assert miss.token_ids == engines.baseline(inside, TOKENS).token_ids


def test_workers_in_their_own_process_restore_the_state_too(engines, cluster):
    """The layout of `vllm serve`: the scheduler's store only answers lookups, the workers'
    store saves and loads; the next turn of a prompt another engine computed hits there."""
    prompt = random_prompt(6, 1500)
    a = node(engines, cluster, "a")
    cold = served(a, prompt)
    ended = prompt + cold.token_ids[:-1]
    wait_for(lambda: end_stored(cluster, a, ended), 60, "the request's end stored")
    tc = cluster.transfer_config("c", namespace={"model": MODEL})
    c = engines.get("c", tc, block_size=BLOCK_SIZE["hybrid"], engine_args=ARGS, inproc=False)
    turn = prompt + cold.token_ids + random_prompt(7, 100)
    hit = served(c, turn)
    assert hit.kv_transfer_params["kvtier"]["hit_tokens"] == {"dram": len(prompt) + TOKENS - 1}
    assert hit.token_ids == engines.baseline(turn, TOKENS).token_ids


@pytest.mark.parametrize("kind", ["nemotronh", "qwen3next"])
def test_other_recurrent_architectures_restore_their_state_too(kind, cluster, tmp_path_factory):
    """A NemotronH shape (Mamba2) and a Qwen3-Next shape (gated delta-net linear attention,
    bfloat16: the CPU build's kernel takes nothing else): the next turn on another engine
    hits at the first turn's end, token-identical to an engine without kvtier."""
    args = ENGINE_ARGS[kind]
    pool = tiny_engines(tmp_path_factory, f"tiny-{kind}", kind, baseline_args=args)
    try:
        def engine(name):  # nodes of their own: an index keeps one model's blocks
            tc = cluster.transfer_config(f"{kind}-{name}", namespace={"model": f"tiny-{kind}"},
                                         chunk_tokens=max(CHUNK, BLOCK_SIZE[kind]))
            return pool.get(name, tc, block_size=BLOCK_SIZE[kind], engine_args=args)
        prompt = random_prompt(8, 2000)
        cold = served(engine("a"), prompt)
        turn = prompt + cold.token_ids + random_prompt(9, 100)
        hit = served(engine("b"), turn)
        assert hit.kv_transfer_params["kvtier"]["hit_tokens"] == {
            "dram": len(prompt) + TOKENS - 1}
        assert hit.token_ids == pool.baseline(turn, TOKENS).token_ids
    finally:
        pool.close()
