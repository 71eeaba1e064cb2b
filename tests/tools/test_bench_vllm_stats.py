"""`kvtier bench vllm`'s statistics: the tail and the worst case against recomputing."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier.tools.bench.vllm import Result, targets  # noqa: E402


def _result(cold, dram, local=(0.01,)) -> Result:
    r = Result(8192)
    r.ttft_s.update(cold=list(cold), dram=list(dram), local=list(local))
    return r


def test_the_tail_is_the_99th_percentile_and_the_worst_of_fewer_than_100():
    r = _result([0.1] * 3, [0.01 * i for i in range(1, 201)])
    assert r.p99_ms("dram") == pytest.approx(1990.0)
    assert _result([0.1], [0.02, 0.03, 0.5]).p99_ms("dram") == pytest.approx(500.0)
    assert r.p99_ms("nvme") is None


def test_one_hit_slower_than_recomputing_misses_the_worst_case_target():
    worst = lambda res: next(t for t in targets([res]) if t["stat"] == "max")  # noqa: E731
    ok = worst(_result([0.30, 0.32, 0.34], [0.05, 0.06, 0.37]))
    assert ok["ok"] and ok["value"] == pytest.approx(0.37 / 0.32, abs=0.01)
    bad = worst(_result([0.30, 0.32, 0.34], [0.05, 0.06, 0.40]))
    assert not bad["ok"] and bad["what"] == "dram / median cold <= 1.2"
