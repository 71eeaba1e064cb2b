"""`kvtier bench serve`: two OpenAI API servers in the README's setup, a hit against recomputing.

The statistics and the argument checks run in the suite; the end-to-end run (two API
servers, a few small prompts) is a long variant.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtier.tools.bench.serve import ServeSpec, _top, node_policy, summarize
from kvtier.tools.cli import app
from kvtier.tools.commands.bench_vllm import _same_token
from kvtier.store.base.config import policy_from_dict


def _row(cold_s, hit_s, hit=None, recomputed=0, same=True, runner_up=False) -> dict:
    return {"cold_s": cold_s, "hit_s": hit_s, "hit_tokens": hit or {"dram": 8000},
            "recomputed_tokens": recomputed, "cached_tokens": 8000, "same_output": same,
            "runner_up": runner_up, "cold_margin": 0.0625}


def test_one_hit_slower_than_1_2x_the_median_cold_misses_the_target():
    rows = [_row(1.0, 0.1), _row(1.2, 0.2), _row(1.4, 1.2)]
    s = summarize(rows)
    assert s["cold_p50_ms"] == 1200.0 and s["hit_p50_ms"] == 200.0
    assert s["hit_p99_ms"] == 1200.0 and s["worst_hit_over_median_cold"] == 1.0 and s["ok"]
    s = summarize(rows[:2] + [_row(1.4, 1.45, {"dram": 256}, recomputed=7744, same=False)])
    assert s["worst_hit_over_median_cold"] == pytest.approx(1.21) and not s["ok"]
    assert s["loaded_tokens"] == 16256 and s["recomputed_tokens"] == 7744
    assert s["different_outputs"] == 1 and s["different_at_runner_up"] == 0
    s = summarize(rows + [_row(1.0, 0.1, same=False, runner_up=True)])
    assert s["different_outputs"] == 1 and s["different_at_runner_up"] == 1


def _body(token: int, top: dict[int, float]) -> dict:
    """A completion as the OpenAI server answers with `logprobs` and token ids."""
    return {"choices": [{"token_ids": [token], "logprobs": {
        "top_logprobs": [{f"token_id:{t}": lp for t, lp in top.items()}]}}]}


def test_a_hit_at_the_colds_runner_up_is_told_from_another_token():
    cold = _body(1077, {1795: -1.83047, 1077: -1.76797})
    assert _top(cold) == [(1077, -1.76797), (1795, -1.83047)]
    assert _top({"choices": [{"token_ids": [5]}]}) == []  # asked without logprobs
    assert _same_token({"same_output": True}) == "yes"
    flip = {"same_output": False, "runner_up": True, "cold_margin": 0.0625}
    assert "runner-up, margin 0.062" in _same_token(flip)
    assert "NO" in _same_token({"same_output": False, "runner_up": False,
                                "cold_margin": 2.0})


def test_an_older_kvtier_without_recomputed_tokens_counts_none():
    assert summarize([_row(1.0, 0.1, recomputed=None)])["recomputed_tokens"] == 0


def test_the_node_policy_is_the_readmes_and_valid(tmp_path):
    files = policy_from_dict(node_policy(tmp_path, "127.0.0.1:5", tmp_path / "shm"))
    assert [t.kind for t in files.tiers] == ["mooncake", "nvme"]
    assert str(files.tiers[0].segment_dir) == str(tmp_path / "shm")
    embedded = policy_from_dict(node_policy(tmp_path, "127.0.0.1:5", None))
    assert embedded.tiers[0].segment_dir is None


@pytest.mark.parametrize("args,word", [
    (["--pool", "service"], "pool must be 'files' or 'embedded'"),
    (["--tokens", "100"], "--tokens"),
    (["--kvtier-path", "/nonexistent-dir"], "no kvtier/ package in it"),
])
def test_bad_arguments_are_refused_in_one_line(args, word):
    res = CliRunner().invoke(app, ["bench", "serve", *args])
    assert res.exit_code == 2 and word in res.output, res.output


def test_the_spec_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="pool must be"):
        ServeSpec(pool="tcp")
    with pytest.raises(ValueError, match="at least 256"):
        ServeSpec(tokens=64)


@pytest.mark.slow
@pytest.mark.vllm
def test_two_api_servers_serve_hits_with_the_same_tokens(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "serve.json"
    res = CliRunner().invoke(app, ["bench", "serve", "--requests", "2", "--tokens", "1024",
                                   "--busy", "0", "--gap-s", "0.5", "--dir",
                                   str(tmp_path / "run"), "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert len(doc["requests"]) == 2
    for r in doc["requests"]:
        assert r["same_output"] and sum(r["hit_tokens"].values()) >= 768, r
    assert doc["metrics_b"]["kvtier_hit_tokens_total"] >= 1536
    assert "worst hit / median cold" in res.output
