"""Tier counters persist per process in the index and sum across processes."""

from __future__ import annotations

import multiprocessing as mp

from kvtier.store.base.index import Index
from kvtier.store.counters import read_counters, write_counters


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
