"""The I/O thread's load order: earliest deadline first, a request's batches in order."""

from __future__ import annotations

from kvtier.connector.io_thread import LoadBatch, LoadQueue


def batches(req: str, n: int, deadline: float | None) -> list[LoadBatch]:
    return [LoadBatch(req, [f"{req}-{i}"], [[i]], 0, last=i == n - 1, deadline=deadline)
            for i in range(n)]


def drain(q: LoadQueue) -> list[str]:
    out = []
    while q:
        out.append(q.pop().keys[0])
    return out


def test_a_short_load_due_first_passes_a_long_one_queued_before_it():
    q = LoadQueue()
    q.extend(batches("long", 4, deadline=10.0))
    first = q.pop()  # the thread took the long load's first batch before the short one came
    q.extend(batches("short", 2, deadline=1.5))
    assert first.keys == ["long-0"]
    assert drain(q) == ["short-0", "short-1", "long-1", "long-2", "long-3"]


def test_batches_of_one_deadline_keep_their_order():
    q = LoadQueue()
    q.extend(batches("a", 3, deadline=5.0))
    q.extend(batches("b", 3, deadline=5.0))
    assert drain(q) == ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2"]


def test_loads_without_a_deadline_come_after_those_with_one_in_arrival_order():
    q = LoadQueue()
    q.extend(batches("free", 2, deadline=None))
    q.extend(batches("due", 1, deadline=100.0))
    q.extend(batches("free2", 1, deadline=None))
    assert drain(q) == ["due-0", "free-0", "free-1", "free2-0"]
    assert len(q) == 0 and not q
