"""Tier counters persist per process in the index and sum across processes."""

from __future__ import annotations

import multiprocessing as mp

from kvtier.store.base.index import Index
from kvtier.store.counters import read_counters, read_prefill, write_counters, write_prefill


def _write(path, node, hits):
    ix = Index(path)
    write_counters(ix, node, {"nvme": {"hits": hits, "bytes_out": 10 * hits}})
    write_counters(ix, node, {"nvme": {"hits": hits + 1, "bytes_out": 10 * hits}})  # cumulative
    ix.close()


def test_counters_sum_over_processes_and_survive_them(tmp_path):
    path = tmp_path / "ix"
    Index(path).close()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write, args=(path, f"n{i}", 5 * (i + 1))) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    ix = Index(path, readonly=True, recover=False)
    totals = read_counters(ix)
    assert totals["nvme"]["hits"] == 6 + 11 + 16
    assert totals["nvme"]["bytes_out"] == 10 * (5 + 10 + 15)
    assert totals["nvme"]["misses"] == 0


def test_no_counters_yet_reads_empty(tmp_path):
    Index(tmp_path / "ix").close()
    assert read_counters(Index(tmp_path / "ix", readonly=True, recover=False)) == {}


def _publish(path, kind, node, prefills):
    ix = Index(path)
    write_prefill(ix, node, kind, {"coef": [0.004, 4e-5, 0.0], "prefills": prefills})
    ix.close()


def test_prefill_models_are_shared_between_processes_per_kind_of_engine(tmp_path):
    path = tmp_path / "ix"
    Index(path).close()
    assert read_prefill(Index(path, readonly=True, recover=False), "fp/1") == []
    ctx = mp.get_context("spawn")
    jobs = [("fp/1", "a", 5), ("fp/1", "b", 9), ("fp/2", "c", 50), ("fp/10", "d", 70)]
    for args in jobs:  # one after another: rows read back oldest first
        p = ctx.Process(target=_publish, args=(path, *args))
        p.start()
        p.join(60)
        assert p.exitcode == 0
    ix = Index(path, readonly=True, recover=False)
    rows = read_prefill(ix, "fp/1")
    assert [r["prefills"] for r in rows] == [5, 9]  # not fp/2's, nor fp/10's
    assert rows[0]["coef"] == [0.004, 4e-5, 0.0] and rows[0]["updated"] <= rows[1]["updated"]
