"""The connector on real vLLM engines: separate processes, one kvtier cluster.

Instances `a`, `b`, `d`, ... are engine processes with the kvtier connector, each its own
node (own index and nvme dir) on one real `mooncake_master` and one shared dir; `baseline`
runs without a connector. Engines live for the whole module and the tests run in file order
(each builds on the blocks the earlier ones left), so the module costs a handful of engine
starts, not one per assertion. Outputs are greedy and compared token for token.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm")

from engine_util import (  # noqa: E402  (tests/connector is on sys.path)
    cluster, CHUNK, Cluster, Engines, chunk_keys, files_of, full_block_tokens, in_pool,
    make_tiny_model, random_prompt, wait_for)

pytestmark = pytest.mark.vllm
TOKENS = 16  # generated per request
LONG = 3000  # prompt length: 46 full chunks, 93 full blocks


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def engines(tiny_model, cluster, tmp_path_factory):
    # depends on `cluster` so that engines close before the master stops (a client whose
    # master is gone spends seconds retrying to unmount its segment)
    pool = Engines(tiny_model, tmp_path_factory.mktemp("engine-logs"))
    yield pool
    pool.close()


def node(engines: Engines, cluster: Cluster, name: str, **kw):
    return engines.get(name, cluster.transfer_config(name), **kw)


def served(engine, prompt, kv_params=None):
    outs, _ = engine.generate([prompt], TOKENS, [kv_params] if kv_params else None)
    return outs[0]


def tier_hits(out) -> dict[str, int]:
    return out.kv_transfer_params["kvtier"]["hit_tokens"]


def wait_persisted(cluster: Cluster, prompt, policy_node="a", timeout_s=60):
    """Until every chunk of `prompt` has a file in the shared tier (the mover wrote it)."""
    keys = chunk_keys(prompt, cluster.policy(policy_node))[: (len(prompt) - 1) // CHUNK]
    wait_for(lambda: len(files_of(cluster.shared, keys)) == len(keys), timeout_s,
             "the mover to persist every chunk to sharedfs")
    return keys


def test_remote_hit_from_another_instance_is_token_identical(engines, cluster):
    prompt = random_prompt(1, LONG)
    a = node(engines, cluster, "a")
    cold = served(a, prompt)
    assert cold.num_cached_tokens == 0
    assert cold.kv_transfer_params["kvtier"]["saved_chunks"] >= LONG // CHUNK
    wait_for(lambda: in_pool(cluster, prompt), 30, "a's saves of the prompt")
    b = node(engines, cluster, "b")
    hint = {"kvtier": {"session_id": "agent-1", "expected_gap_s": 5.0}}
    hit = served(b, prompt, hint)
    assert tier_hits(hit) == {"dram": hit.num_cached_tokens}  # all of it from the pool
    assert hit.num_cached_tokens >= 0.9 * full_block_tokens(prompt)
    assert hit.token_ids == cold.token_ids == engines.baseline(prompt, TOKENS).token_ids


def test_partial_hit_and_a_load_that_starts_inside_the_local_hit(engines, cluster):
    prompt = random_prompt(1, LONG)
    longer = prompt + random_prompt(11, 1000)
    a, b = node(engines, cluster, "a"), node(engines, cluster, "b")
    assert served(b, prompt).num_cached_tokens >= full_block_tokens(prompt) - CHUNK
    # b holds it in its local prefix cache now
    served(a, longer)  # a computes and saves the continuation
    # a lender saves after it answers: on a busy host b could ask before the pool has them
    wait_for(lambda: in_pool(cluster, longer), 30, "a's saves of the continuation")
    out = served(b, longer)
    local = full_block_tokens(prompt)
    assert "dram" in tier_hits(out), out.kv_transfer_params["kvtier"]
    loaded = tier_hits(out)["dram"]
    # b's local hit ends inside a chunk: the load starts at that chunk without touching it
    assert local % CHUNK and loaded == out.num_cached_tokens - local
    assert out.num_cached_tokens >= 0.9 * full_block_tokens(longer)
    assert out.token_ids == engines.baseline(longer, TOKENS).token_ids
    prefix_only = served(node(engines, cluster, "e"), prompt[:2000] + random_prompt(12, 500))
    assert tier_hits(prefix_only) == {"dram": 2000 // CHUNK * CHUNK}


def test_after_the_pool_is_wiped_hits_come_from_disk(engines, cluster):
    prompt = random_prompt(2, LONG)
    served(node(engines, cluster, "a"), prompt)
    wait_persisted(cluster, prompt)
    cluster.restart_master()  # the DRAM pool is empty now
    fresh = node(engines, cluster, "d")  # a new process on a new node: only sharedfs has it
    out = served(fresh, prompt)
    assert set(tier_hits(out)) == {"shared"}, tier_hits(out)
    assert out.num_cached_tokens >= 0.9 * full_block_tokens(prompt)
    assert out.token_ids == engines.baseline(prompt, TOKENS).token_ids
    a = node(engines, cluster, "a")
    a.reset_prefix_cache()
    again = served(a, prompt)  # a's own node: nvme (or the pool, if d's hit was promoted)
    assert set(tier_hits(again)) <= {"dram", "nvme", "shared"} and tier_hits(again)
    assert again.num_cached_tokens >= 0.9 * full_block_tokens(prompt)
    assert again.token_ids == out.token_ids


@pytest.mark.parametrize("load", ["async", "sync"])
def test_a_corrupt_block_on_disk_is_recomputed(engines, cluster, load):
    """`async` loads before the request runs (vLLM recovers a waiting request); `sync` in
    the step that runs it (vLLM recovers a running one)."""
    prompt = random_prompt(3 if load == "async" else 33, LONG)
    served(node(engines, cluster, "a"), prompt)
    keys = wait_persisted(cluster, prompt)
    cluster.restart_master()  # only the disk tiers hold it
    bad = 10
    path = files_of(cluster.shared, [keys[bad]])[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the payload
    path.write_bytes(bytes(data))
    name = "e" if load == "async" else f"e-{load}"  # "e": the default, shared with others
    config = cluster.transfer_config(name)
    config["kv_connector_extra_config"]["load"] = load
    e = engines.get(name, config)
    out = served(e, prompt)
    assert out.token_ids == engines.baseline(prompt, TOKENS).token_ids
    # vLLM recomputed from the bad chunk on (and kvtier saved those chunks again)
    kv = out.kv_transfer_params["kvtier"]
    assert kv["saved_chunks"] == len(keys) + 1 - bad
    # vLLM still counts the recomputed tokens as cached; what a cache served is what loaded
    assert kv["recomputed_tokens"] > 0
    assert out.served_tokens == sum(kv["hit_tokens"].values()) == bad * CHUNK
    assert out.num_cached_tokens == out.served_tokens + kv["recomputed_tokens"]
    quarantined = [p for p in (cluster.shared / ".quarantine").rglob("*") if keys[bad] in p.name]
    assert quarantined, "the corrupt file was not quarantined"
    # the recomputed chunks were saved again: e's mover puts them back on the shared tier
    wait_persisted(cluster, prompt, policy_node=name)
    e.reset_prefix_cache()
    healed = served(e, prompt)
    assert healed.num_cached_tokens >= 0.9 * full_block_tokens(prompt)
    assert healed.token_ids == out.token_ids


def test_master_killed_while_requests_run(engines, cluster):
    a, b = node(engines, cluster, "a"), node(engines, cluster, "b")
    hot = random_prompt(4, LONG)
    served(a, hot)  # in the pool: b's load of it races the kill
    prompts = [hot] + [random_prompt(40 + i, 2000) for i in range(3)]
    expected = [o.token_ids for o in engines.baselines(prompts, 64)]
    killer = threading.Timer(0.3, cluster.kill_master)
    killer.start()
    outs, _ = b.generate(prompts, 64)
    killer.join()
    assert [o.token_ids for o in outs] == expected  # every request completed, identically
    cluster.start_master()
    attempt = iter(range(500, 600))

    def pool_serves_again() -> bool:
        fresh = random_prompt(next(attempt), 1500)  # new each time: a saves only new chunks
        served(a, fresh)
        out = served(b, fresh)
        assert out.token_ids == engines.baseline(fresh, TOKENS).token_ids
        return "dram" in tier_hits(out)
    wait_for(pool_serves_again, 60, "hits from the restarted master's pool")


def test_as_a_multiconnector_child(engines, cluster, tmp_path):
    example_dir = tmp_path / "example-connector"
    example_dir.mkdir()
    kvtier = cluster.transfer_config("f")
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_load_failure_policy": "recompute",
             "kv_connector_extra_config": {"connectors": [
                 kvtier, {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {
                              "shared_storage_path": str(example_dir)}}]}}
    f = engines.get("f", multi)
    prompt = random_prompt(7, LONG)
    served(node(engines, cluster, "a"), prompt)  # now in kvtier
    out = served(f, prompt)
    assert out.num_cached_tokens >= 0.9 * full_block_tokens(prompt)
    assert tier_hits(out) and out.token_ids == engines.baseline(prompt, TOKENS).token_ids
    new = random_prompt(6, 1500)
    first = served(f, new)
    assert first.kv_transfer_params["kvtier"]["saved_chunks"] >= 1500 // CHUNK
    assert any(example_dir.iterdir())  # the other child saved too
    assert first.token_ids == engines.baseline(new, TOKENS).token_ids


def test_preempted_requests_resume_from_kvtier(engines, cluster):
    g = engines.get("g", cluster.transfer_config("g"), num_blocks=120, max_model_len=2048)
    prompts = [random_prompt(70 + i, 600) for i in range(8)]
    outs, _ = g.generate(prompts, 400)  # 8 x 1000 tokens in a 3840-token cache
    resumed = [o for o in outs if tier_hits(o)]
    assert resumed, "expected preemption: raise the load or shrink num_blocks"
    assert [o.token_ids for o in outs] == [o.token_ids for o in engines.baselines(prompts, 400)]


def test_auto_loads_a_lone_request_in_its_step_and_others_beside_running_ones(engines,
                                                                             cluster):
    """`load: auto`: a hit with nothing else running loads in the step that runs it; hits
    that arrive while another request decodes load in the background. Both are the engine's
    own output."""
    prompts = [random_prompt(40 + i, LONG) for i in range(3)]
    a = node(engines, cluster, "a")
    for p in prompts:
        served(a, p)  # computed and saved by a
    config = cluster.transfer_config("e-auto")
    config["kv_connector_extra_config"]["load"] = "auto"
    e = engines.get("e-auto", config)
    lone = served(e, prompts[0])
    running = threading.Event()
    # decodes while the others arrive (submitted once it runs: a request that joins in the
    # same step is looked up before that step schedules anything)
    busy = e.submit(random_prompt(43, 200), 300, on_first=lambda _: running.set())
    assert running.wait(120)
    beside = [f.result(300) for f in [e.submit(p, TOKENS) for p in prompts[1:]]]
    assert not busy.done(), "the long request ended before the others were looked up"
    busy.result(300)
    loads = [out.kv_transfer_params["kvtier"]["loads"] for out in [lone] + beside]
    assert loads == [{"async": 0, "sync": 1}] + [{"async": 1, "sync": 0}] * 2
    for out, p in zip([lone] + beside, prompts):
        assert out.num_cached_tokens >= 0.9 * full_block_tokens(p)
        assert out.token_ids == engines.baseline(p, TOKENS).token_ids


def test_a_bad_connector_config_stops_the_engine_with_one_line(tiny_model, tmp_path):
    from kvtier.tools.vllm_engine import Engine, EngineError, kvtier_transfer_config
    bad = kvtier_transfer_config(None, kvtier_confg="policy.yaml")
    with pytest.raises(EngineError, match=r"ConfigError: kv_connector_extra_config: "
                                          r"kvtier_confg: unknown field; expected one of"):
        Engine(tiny_model, tmp_path / "bad.log", kv_transfer_config=bad, dtype="float32")


@pytest.mark.slow
def test_multiprocess_engine_loads_a_16k_prompt(engines, cluster):
    """vLLM's default layout: scheduler and worker in separate processes (metadata pickled)."""
    prompt = random_prompt(8, 16000)
    served(node(engines, cluster, "a"), prompt)
    mp = engines.get("mp", cluster.transfer_config("mp"), inproc=False)
    out = served(mp, prompt)
    assert set(tier_hits(out)) <= {"dram", "nvme", "shared"} and tier_hits(out)
    assert out.num_cached_tokens >= 0.9 * full_block_tokens(prompt)
    assert out.token_ids == engines.baseline(prompt, TOKENS).token_ids


def test_a_remote_hit_read_from_the_lenders_segment_file_is_token_identical(engines, cluster,
                                                                             tmp_path):
    """Both engines lend their pool segments from files (`segment_dir`): b scatters a's
    chunks straight out of a's file into its paged cache, and answers as if it computed."""
    from kvtier.tools.vllm_engine import kvtier_transfer_config

    def files_node(name: str):
        policy = cluster.policy(name)
        policy["tiers"][0]["segment_dir"] = str(tmp_path / "shm")
        return engines.get(name, kvtier_transfer_config(policy, node_id=name))
    prompt = random_prompt(9, LONG)
    try:
        cold = served(files_node("fa"), prompt)
        assert cold.num_cached_tokens == 0
        hit = served(files_node("fb"), prompt)
        assert tier_hits(hit) == {"dram": hit.num_cached_tokens}
        assert hit.num_cached_tokens >= 0.9 * full_block_tokens(prompt)
        assert hit.token_ids == cold.token_ids == engines.baseline(prompt, TOKENS).token_ids
    finally:
        engines.stop("fb")
        engines.stop("fa")
