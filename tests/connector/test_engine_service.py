"""The connector through the node's pool service: engine processes share one segment over
shared memory (tiers[dram].service), and blocks outlive the engine that computed them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_util import (  # noqa: E402  (tests/connector is on sys.path)
    Cluster, Engines, full_block_tokens, make_tiny_model, random_prompt)
from kvtier.store.base.config import MasterConfig, policy_from_dict  # noqa: E402
from kvtier.tiers.mooncake.master import free_port  # noqa: E402
from kvtier.tiers.mooncake.service import PoolService  # noqa: E402
from kvtier.tools.vllm_engine import kvtier_transfer_config  # noqa: E402

pytestmark = pytest.mark.vllm
TOKENS = 16
LONG = 3000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster-service"))
    address = f"127.0.0.1:{free_port()}"
    dram = policy_from_dict(policy(c, "probe", address)).tiers[0]
    c.service = PoolService(dram, MasterConfig(address=c.address, embedded=False)).start()
    yield c
    c.service.stop()
    c.close()


@pytest.fixture(scope="module")
def engines(tmp_path_factory, cluster):
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")
    pool = Engines(model, tmp_path_factory.mktemp("engine-logs"))
    yield pool
    pool.close()


def policy(cluster: Cluster, node: str, address: str) -> dict:
    data = cluster.policy(node, tiers=("dram",))
    data["tiers"][0] |= {"capacity": "256MiB", "service": address, "service_embedded": False}
    return data


def engine(engines: Engines, cluster: Cluster, name: str):
    pol = policy(cluster, name, cluster.service.address)
    return engines.get(name, kvtier_transfer_config(pol, node_id=name))


def served(eng, prompt):
    outs, _ = eng.generate([prompt], TOKENS)
    return outs[0]


def test_remote_hit_through_the_service_is_token_identical(engines, cluster):
    prompt = random_prompt(31, LONG)
    a = engine(engines, cluster, "a")
    cold = served(a, prompt)
    assert cold.num_cached_tokens == 0
    hit = served(engine(engines, cluster, "b"), prompt)
    assert hit.kv_transfer_params["kvtier"]["hit_tokens"] == {"dram": hit.num_cached_tokens}
    assert hit.num_cached_tokens >= 0.9 * full_block_tokens(prompt)
    assert hit.token_ids == cold.token_ids == engines.baseline(prompt, TOKENS).token_ids


def test_blocks_outlive_the_engine_that_computed_them(engines, cluster):
    prompt = random_prompt(32, LONG)
    a = engine(engines, cluster, "a")
    cold = served(a, prompt)
    assert cold.kv_transfer_params["kvtier"]["saved_chunks"] > 0
    engines.stop("a")  # an embedded client would take its segment, and these blocks, along
    hit = served(engine(engines, cluster, "c"), prompt)
    assert hit.kv_transfer_params["kvtier"]["hit_tokens"] == {"dram": hit.num_cached_tokens}
    assert hit.num_cached_tokens >= 0.9 * full_block_tokens(prompt)
    assert hit.token_ids == cold.token_ids
