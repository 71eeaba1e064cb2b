"""The real-time replay driver (`tools.replay.live`) against scripted backends: requests go to
an engine as they come (no batch barrier), at most `max_inflight` at once per instance, and a
request's TTFT counts its wait in the instance's queue."""

from __future__ import annotations

import threading

import pytest

from kvtier.tools.replay import live as replay_live
from kvtier.tools.replay.experiment import EngineSpec, build_plan
from kvtier.tools.replay.live import run_live
from kvtier.tools.replay.metrics import summarize
from kvtier.tools.replay.router import make_router

SERVICE_S = 0.3  # each scripted request's length; the plan's sessions start ms apart


class Scripted:
    """Completes each request `SERVICE_S` after its submit, on a thread of its own, with a
    first token at a tenth of it; counts the requests it holds at once."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.lock = fail_at, threading.Lock()
        self.inflight = self.most = 0

    def submit(self, i: int, done) -> None:
        with self.lock:
            self.inflight += 1
            self.most = max(self.most, self.inflight)
        threading.Timer(SERVICE_S, self._finish, (i, done)).start()

    def _finish(self, i: int, done) -> None:
        with self.lock:
            self.inflight -= 1
        if i == self.fail_at:
            done(RuntimeError("engine died"))
            return
        done({"cached": 64, "tiers": {"dram": 32}, "saved_chunks": 1, "output_tokens": 4,
              "ttft_s": SERVICE_S / 10, "e2e_s": SERVICE_S, "queued_s": 0.01,
              "recomputed": 32 if i % 2 else 0, "declined": 16 if i % 3 == 0 else 0})


@pytest.fixture(scope="module")
def plan():
    return build_plan(EngineSpec(turns=2, scale=0.05), 3)  # 3 sessions, 6 requests


def test_requests_join_a_busy_engine_without_waiting_for_the_others(plan):
    backend = Scripted()
    recs = run_live(plan, [backend], make_router("round-robin", 1), speed=1000,
                    max_inflight=8)
    assert [r["i"] for r in recs] == list(range(len(plan)))
    assert backend.most >= 2  # the sessions' first turns overlap on the one engine
    firsts = sorted((r for r in recs if r["turn"] == 0), key=lambda r: r["start"])
    assert firsts[1]["start"] < firsts[0]["end"]  # sent while the first was running
    for r in recs:
        assert r["ttft"] == pytest.approx(r["start"] - r["sent"] + SERVICE_S / 10)
        assert r["e2e"] == r["end"] - r["sent"] and r["queued_s"] == 0.01
        assert r["tiers"] == {"dram": 32} and r["cached"] == 64
        # what the engine recomputed of a promise, or declined, reaches the report
        assert r["recomputed"] == (32 if r["i"] % 2 else 0)
        assert r["declined"] == (16 if r["i"] % 3 == 0 else 0)
    summary = summarize(recs, ["dram"], 1, 32, kv_tokens=1 << 20)
    inputs = sum(r["input_tokens"] for r in recs)
    assert summary["overall"]["recomputed_pct"] == pytest.approx(
        100.0 * 32 * sum(r["i"] % 2 for r in recs) / inputs)
    assert summary["overall"]["declined_pct"] > 0


def test_a_full_instance_queues_and_the_wait_counts_in_ttft(plan):
    backend = Scripted()
    recs = run_live(plan, [backend], make_router("round-robin", 1), speed=1000,
                    max_inflight=1)
    assert backend.most == 1
    waited = [r for r in recs if r["start"] - r["sent"] > SERVICE_S / 2]
    assert waited  # sessions that came while the engine was full
    for r in waited:
        assert r["ttft"] > r["start"] - r["sent"]
    spans = sorted((r["start"], r["end"]) for r in recs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one at a time


def test_a_failed_request_stops_the_replay_with_its_error(plan):
    with pytest.raises(RuntimeError, match="engine died"):
        run_live(plan, [Scripted(fail_at=1), Scripted(fail_at=1)],
                 make_router("round-robin", 2), speed=1000)


class Hung:
    def submit(self, i: int, done) -> None:
        pass  # never answers


def test_a_request_that_never_ends_stops_the_replay(plan, monkeypatch):
    monkeypatch.setattr(replay_live, "REQUEST_TIMEOUT_S", 0.5)
    with pytest.raises(TimeoutError, match="hung engine"):
        run_live(plan, [Hung()], make_router("round-robin", 1), speed=1000)
