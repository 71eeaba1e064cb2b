"""`kvtier replay --engine sim|vllm` end to end, small: real master, real tiers, real engines.

Every assertion compares configurations measured in the same run (kvtier against vLLM's own
prefix caches, against a DRAM-only pool of the same size); none is a fixed timing threshold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.tools.cli import app


def replay(tmp_path, *args: str) -> dict:
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["replay", *args, "--out", str(out), "--json",
                                   str(tmp_path / "r.json")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert (out / f"replay-{args[1]}.json").exists()
    for png in report.get("plots", []):
        assert png.endswith(".png") and (tmp_path / "out" / png.split("/")[-1]).stat().st_size
    return report


def overall(report: dict, label: str, run: int = 0) -> dict:
    return report["runs"][run]["configs"][label]["overall"]


def test_sim_round_robin_kvtier_beats_local_caches_and_matches_a_big_dram_pool(tmp_path):
    report = replay(tmp_path, "--engine", "sim", "--instances", "2", "--sessions", "4",
                    "--turns", "5", "--scale", "0.05", "--dram", "1.5",
                    "--baselines", "local,dram-only")
    kv, local, dram = (overall(report, x) for x in ("kvtier", "local", "dram-only"))
    assert kv["hit_rate"] >= local["hit_rate"] + 10
    assert kv["hit_rate"] >= dram["hit_rate"] - 0.5      # the same pool holds everything
    assert kv["hit_by_tier"]["dram"] > 0 and kv["bytes_read"]["dram"] > 0
    assert kv["ttft_p50_s"] < local["ttft_p50_s"]        # modeled from the same calibration
    turns = report["runs"][0]["configs"]
    for k, (a, b) in enumerate(zip(turns["kvtier"]["per_turn"], turns["local"]["per_turn"])):
        assert a["hit_rate"] >= b["hit_rate"] - 1e-9, k
    assert report["runs"][0]["configs"]["kvtier"]["overall"]["kv_ratio"] > 1
    assert {t["what"] for t in report["targets"]} >= {"kvtier token hit rate %"}


def test_sim_small_dram_pool_keeps_hits_with_tiers_below_where_dram_only_loses_them(tmp_path):
    report = replay(tmp_path, "--engine", "sim", "--instances", "2", "--sessions", "10",
                    "--turns", "12", "--scale", "0.1", "--dtype", "float32",
                    "--dram", "1.5,0.4", "--baselines", "dram-only")
    full, small = overall(report, "kvtier@150%"), overall(report, "kvtier@40%")
    dram_small = overall(report, "dram-only@40%")
    assert small["hit_rate"] >= full["hit_rate"] - 2
    assert dram_small["hit_rate"] <= small["hit_rate"] - 5
    assert small["hit_by_tier"]["nvme"] + small["hit_by_tier"]["shared"] > 0
    check = [t for t in report["targets"] if "DRAM at 40%" in t["what"]]
    assert check and check[0]["ok"]


@pytest.mark.vllm
def test_vllm_two_engines_round_robin_kvtier_beats_their_own_prefix_caches(tmp_path):
    pytest.importorskip("vllm")
    from kvtier.tools.replay.vllm_cluster import SEGMENT_TMPFS
    report = replay(tmp_path, "--engine", "vllm", "--instances", "2", "--sessions", "3",
                    "--turns", "3", "--scale", "0.05", "--speed", "4",
                    "--baselines", "local")
    kv, local = overall(report, "kvtier"), overall(report, "local")
    assert kv["requests"] == local["requests"] == 9
    assert kv["hit_rate"] >= local["hit_rate"] + 10
    assert kv["hit_by_tier"]["dram"] > 0     # turns moved between engines found the pool
    # what the nodes' indexes hold once the engines are gone: the shared dir keeps every
    # persisted block; the indexes keep no record of pool blocks (the master has them)
    held = report["runs"][0]["configs"]["kvtier"]["held"]
    assert held["shared"]["blocks"] > 0 and "dram" not in held
    # the default pool is the README's: each engine lends its share from a file (two 16 MiB
    # segments fit even Docker's 64 MiB /dev/shm), and the run's directory is gone after
    assert report["runs"][0]["configs"]["kvtier"]["pool"] == "files"
    assert not list(Path(SEGMENT_TMPFS).glob("kvtier-replay-*"))


@pytest.mark.vllm
@pytest.mark.parametrize("peer", ["mooncake-store", "mooncake-store+ssd", "lmcache"])
def test_vllm_a_peer_connector_runs_the_same_plan_as_a_baseline(tmp_path, peer):
    # A peer as its users run it, on the same plan and engines: its pool finds the turns
    # moved between engines too, and the report compares kvtier with it at the same size.
    pytest.importorskip("vllm")
    if peer == "lmcache":  # not kvtier's dependency: built by `make peers`
        from kvtier.tools.bench.lmcache_peer import peers_dir, venv_problem
        problem = venv_problem(peers_dir() / "lmcache")
        if problem:
            pytest.skip(problem)
    report = replay(tmp_path, "--engine", "vllm", "--instances", "2", "--sessions", "3",
                    "--turns", "3", "--scale", "0.05", "--speed", "4",
                    "--baselines", f"local,{peer}")
    kv, theirs, local = (overall(report, x) for x in ("kvtier", peer, "local"))
    assert kv["requests"] == theirs["requests"] == local["requests"] == 9
    assert theirs["hit_rate"] >= local["hit_rate"] + 10
    assert report["runs"][0]["configs"][peer]["segment_bytes"] == \
        report["runs"][0]["configs"]["kvtier"]["segment_bytes"]
    checks = {t["what"] for t in report["targets"]}
    assert f"kvtier hit rate % against {peer}" in checks
    assert f"kvtier TTFT P50 / {peer}'s" in checks


def test_a_peer_baseline_needs_real_engines():
    from kvtier.tools.replay.cluster import ReplayError
    from kvtier.tools.replay.experiment import EngineSpec
    with pytest.raises(ReplayError, match="--baselines mooncake-store: .* --engine vllm"):
        EngineSpec(engine="sim", baselines=("mooncake-store",)).check()
    with pytest.raises(ReplayError, match="unknown 'lru'; known: local, dram-only, mooncake"):
        EngineSpec(engine="vllm", baselines=("lru",)).check()


def test_a_peer_that_is_not_installed_is_skipped_with_its_reason(tmp_path, monkeypatch):
    from kvtier.tools.replay.cluster import configs
    from kvtier.tools.replay.experiment import _runnable
    monkeypatch.setenv("KVTIER_PEERS_DIR", str(tmp_path / "no-peers"))
    said = []
    ui = type("UI", (), {"say": staticmethod(said.append)})
    kept = _runnable(configs((1.5,), ("local", "lmcache", "mooncake-store")), ui)
    assert [c.kind for c in kept] == ["kvtier", "mooncake-store", "local"]
    assert said and "lmcache" in said[0] and "make peers" in said[0]

