"""One store per process and policy, shared by the connector sides that live there."""

from __future__ import annotations

from kvtier.connector import storeref
from kvtier.store.base.config import policy_from_dict


def _policy(tmp_path):
    return policy_from_dict({
        "index": {"path": str(tmp_path / "index"), "map_size": "32MiB"},
        "tiers": [{"name": "shared", "kind": "sharedfs", "path": str(tmp_path / "shared"),
                   "capacity": "64MiB"}]})


def test_a_lookup_only_store_gains_a_mover_when_a_worker_side_joins(tmp_path):
    policy = _policy(tmp_path)
    sched = storeref.acquire(policy, "n", mover=False)
    try:
        assert not sched.runs_mover  # a scheduler-only process forwards its events
        worker = storeref.acquire(policy, "n", mover=True)
        assert worker is sched and sched.runs_mover
        storeref.release(worker)
        assert not sched._closed  # the scheduler side still holds it
    finally:
        storeref.release(sched)
    assert sched._closed


def test_a_worker_side_first_shares_its_mover(tmp_path):
    policy = _policy(tmp_path)
    worker = storeref.acquire(policy, "n", mover=True)
    sched = storeref.acquire(policy, "n", mover=False)
    try:
        assert sched is worker and sched.runs_mover
    finally:
        storeref.release(sched)
        storeref.release(worker)


def test_a_step_end_reaches_the_worker_sides_of_the_same_engine_only(tmp_path):
    policy = _policy(tmp_path)
    seen: list[str] = []
    stop_a = storeref.on_step_end(policy, "a", lambda: seen.append("a"))
    stop_b = storeref.on_step_end(policy, "b", lambda: seen.append("b"))
    try:
        storeref.step_ended(policy, "a")
        assert seen == ["a"]
        stop_a()
        storeref.step_ended(policy, "a")  # no worker side listens: nothing
        storeref.step_ended(policy, "b")
        assert seen == ["a", "b"]
    finally:
        stop_a()  # idempotent
        stop_b()
    storeref.step_ended(policy, "b")
    assert seen == ["a", "b"]
