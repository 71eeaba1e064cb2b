"""`kvtier bench gather` on the CPU, small: the save/load round trip restores every byte, and
the check after an in-place load is timed each way the layout allows (every chunk must pass
it, or the bench raises)."""

from __future__ import annotations

import json

import pytest

from kvtier.connector.harness.gather_bench import main

SMALL = ["--device", "cpu", "--layers", "2", "--heads", "2", "--head-size", "16",
         "--block-size", "16", "--chunk-tokens", "32", "--blocks", "64", "--cache-blocks",
         "256", "--reps", "2"]


@pytest.mark.parametrize("layout, in_cache", [("LBHNC", True), ("LBNHC", False)])
def test_bench_gather_round_trips_and_times_the_checks(tmp_path, layout, in_cache):
    out = tmp_path / "g.json"
    main([*SMALL, "--layout", layout, "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["round_trip_ok"] and res["chunks"] == 32
    want = {"check_frame", "check_copy"} | ({"check_cache"} if in_cache else set())
    assert set(res["check_ms"]) == want
    assert all(v > 0 for v in res["check_ms"].values())


def test_bench_gather_runs_the_io_thread_end_to_end(tmp_path):
    """`--io-thread`: save then load through the real I/O thread; every byte comes back."""
    out = tmp_path / "g.json"
    main([*SMALL, "--layout", "LBHNC", "--io-thread", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["io_thread_round_trip_ok"] and res["io_thread_failed_blocks"] == 0
