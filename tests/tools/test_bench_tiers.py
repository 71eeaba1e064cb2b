"""`kvtier bench tiers`: a tiny real run on the mooncake tier (numbers, ratios, JSON), fio's
JSON parsing and one real fio job, and the target rules."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvtier.tools.bench import fio as bench_fio

from kvtier.tools.bench import tiers as bench_tiers
from kvtier.tools.bench.report import Row, check_targets, link_references

KiB, MiB = 1 << 10, 1 << 20
TINY = bench_tiers.BenchSpec(sizes=(256 * KiB,), batches=(1, 4), op_bytes=2 * MiB,
                             max_batch_bytes=4 * MiB, min_iters=2, max_iters=4, fio=False)


def test_mooncake_against_raw_in_one_run(tmp_path):
    rows, refs, targets = bench_tiers.run_bench(TINY, root=tmp_path, only={"dram"})
    assert {r.target for r in rows} == {"dram[zero-copy]", "dram[staging]"}
    assert {r.target for r in refs} == {"raw mooncake", "raw mooncake+verify"}
    assert len(rows) == 2 * 2 * 2  # 2 variants x 2 batches x (put, get)
    for row in rows:
        assert row.gbps > 0 and 0 < row.p50_ms <= row.p99_ms
        assert row.reference == "raw mooncake" and row.ratio == pytest.approx(
            row.gbps / row.ref_gbps)
        assert row.extra["vs_verify_floor"] > 0
    assert len(targets) == 4 and all(t["target"].startswith("dram[zero-copy]") for t in targets)


def test_the_readme_setup_is_measured_beside_a_raw_client_of_its_own(tmp_path):
    """`dram-files`: the pool lent from segment files in /dev/shm, each case beside a raw
    client that lends from a file too, under a reference name of its own; the files go with
    the run."""
    before = set(bench_tiers.SHM.glob("kvtier-bench-*"))
    shm, why = bench_tiers.segment_dir_for(TINY)
    if shm is None:
        pytest.skip(f"no room for the files tier here: {why}")
    shm.rmdir()
    rows, refs, targets = bench_tiers.run_bench(TINY, root=tmp_path, only={"mooncake"})
    files = [r for r in rows if r.target.startswith("dram-files[")]
    assert {r.target for r in files} == {"dram-files[zero-copy]", "dram-files[staging]"}
    assert {r.target for r in refs} == {"raw mooncake", "raw mooncake+verify",
                                        "raw mooncake [dram-files]",
                                        "raw mooncake [dram-files]+verify"}
    for row in files:
        assert row.reference == "raw mooncake [dram-files]" and row.ratio == pytest.approx(
            row.gbps / row.ref_gbps) and row.extra["vs_verify_floor"] > 0
    assert {r.reference for r in rows if r.target.startswith("dram[")} == {"raw mooncake"}
    assert sum(t["target"].startswith("dram-files[zero-copy]") for t in targets) == 4
    assert set(bench_tiers.SHM.glob("kvtier-bench-*")) == before  # nothing left in /dev/shm


def test_a_shm_or_memory_too_small_for_the_files_tier_is_named(tmp_path, monkeypatch):
    assert bench_tiers._mem_available() > 0  # /proc/meminfo read
    shm, why = bench_tiers.segment_dir_for(TINY, tmp_path / "missing")
    assert shm is None and why == f"{tmp_path / 'missing'} is not usable (No such file or directory)"

    class Tiny:
        f_bavail, f_frsize = 16, 4096

    monkeypatch.setattr(bench_tiers.os, "statvfs", lambda path: Tiny())
    shm, why = bench_tiers.segment_dir_for(TINY, tmp_path)
    need = 2 * bench_tiers.pool_mib(TINY)
    assert shm is None and why == (f"{tmp_path} has 0 MiB free and its two segment files "
                                   f"need {need} MiB (--quick needs less; Docker: --shm-size)")
    assert not list(tmp_path.iterdir())

    class Roomy:
        f_bavail, f_frsize = 1 << 30, 4096

    monkeypatch.setattr(bench_tiers.os, "statvfs", lambda path: Roomy())
    monkeypatch.setattr(bench_tiers, "_mem_available", lambda: need * MiB)
    shm, why = bench_tiers.segment_dir_for(TINY, tmp_path)
    assert shm is None and why == (f"{need} MiB of memory available, and its two segment "
                                   f"files need {need} MiB beside the private pool's "
                                   "(--quick needs less)")
    assert not list(tmp_path.iterdir())


def test_cli_writes_json(tmp_path):
    from typer.testing import CliRunner

    from kvtier.tools.cli import app

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "tiers", "--quick", "--tiers", "dram",
                                      "--sizes", "256KiB", "--batches", "2", "--no-fio",
                                      "--dir", str(tmp_path / "b"), "--json", str(out),
                                      "--markdown", str(tmp_path / "bench.md")])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["machine"]["cores"] >= 1 and doc["spec"]["sizes"] == [256 * KiB]
    assert {r["target"] for r in doc["results"]} == {"dram[zero-copy]", "dram[staging]"}
    assert "ratio" in result.output and "raw mooncake" in result.output
    md = (tmp_path / "bench.md").read_text()
    assert md.startswith("| target |") and "| dram[zero-copy] | get | 256KiB | 2 |" in md


def test_a_tier_name_that_measures_nothing_is_refused_with_the_names_there(tmp_path):
    """A typo in `--tiers` is an error naming what there is (it used to print an empty
    table); it starts no master and leaves no temp dir behind."""
    out = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "bench", "tiers",
                          "--quick", "--tiers", "dram,nvme2", "--no-fio"],
                         env={**os.environ, "TMPDIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert out.stderr == ("kvtier: --tiers: no tier or kind named 'nvme2' here; choose from "
                          "dram, dram-files, mooncake, nvme, shared, sharedfs, verify\n")
    assert not list(tmp_path.iterdir())


def test_a_temp_dir_of_its_own_is_removed_after_a_clean_run(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_tiers.tempfile, "tempdir", str(tmp_path))
    rows, _, _ = bench_tiers.run_bench(TINY, only={"shared"})
    assert rows and {r.target for r in rows} == {"shared"}
    assert not list(tmp_path.iterdir())


def test_parse_fio_json():
    text = ('note: both iodepth >= 1 and synchronous I/O engine\n{"jobs": [{"read": {'
            '"bw_bytes": 2000000000, "clat_ns": {"percentile": {"50.000000": 1500000, '
            '"99.000000": 4000000}}}, "write": {"bw_bytes": 0}}]}')
    res = bench_fio.parse_fio(text, "read", 2 * MiB, 32, 64 * MiB)
    assert res.gbps == 2.0 and res.p50_ms == 1.5 and res.p99_ms == 4.0


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_real_fio_write_then_read(tmp_path):
    write = bench_fio.run_fio(tmp_path, "write", 256 * KiB, 4, 8 * MiB)
    read = bench_fio.run_fio(tmp_path, "read", 256 * KiB, 4, 8 * MiB)
    assert write.gbps > 0 and read.gbps > 0 and read.p99_ms >= read.p50_ms > 0


def test_targets_judge_nvme_at_2mib_and_uring_against_psync():
    def row(target, op, block, batch, gbps, **extra):
        return Row(target, "nvme", op, block, batch, gbps, 1, 2, reference="fio",
                   extra={"ref_batch": 32 if batch > 1 else 1, **extra})

    rows = [row("nvme[uring]", "put", 2 * MiB, 64, 1.7, engine="uring"),
            row("nvme[psync]", "put", 2 * MiB, 64, 1.0, engine="psync"),
            row("nvme[uring]", "put", 256 * KiB, 64, 0.1, engine="uring")]
    refs = [Row("fio", "reference", "write", 2 * MiB, 32, 2.0, 1, 2),
            Row("fio", "reference", "write", 256 * KiB, 32, 2.0, 1, 2)]
    link_references(rows, refs)
    assert rows[0].ratio == pytest.approx(0.85)
    got = {t["target"]: t["met"] for t in check_targets(rows)}
    assert got == {"nvme[uring] put >= 80% of fio": True,
                   "nvme[uring] put beats psync at queue depth > 1": True}


# Known answers: a candidate that hashed nothing would rate as fast as it likes.
KNOWN = {"xxh3-64": (b"", 0x2D06800538D394C2), "crc32 (zlib)": (b"123456789", 0xCBF43926),
         "crc32c": (b"123456789", 0xE3069283),
         "blake3": (b"", bytes.fromhex("af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7"
                                       "cc9a93cae41f3262"))}


def test_hash_candidates_hash_right_and_are_rated_or_named():
    from kvtier.tools.bench.checksum import hash_candidates, hash_rows

    cands, missing = hash_candidates()
    for name, (fn, _) in cands.items():
        data, want = KNOWN[name.split(" hash")[0]]
        assert fn(memoryview(data)) == want, name
    rows, skipped = hash_rows([64 * KiB], 1 * MiB, rounds=2)
    assert skipped == missing
    assert {r.target for r in rows} == set(cands)
    assert {"xxh3-64 hash", "crc32 (zlib) hash"} <= {r.target for r in rows}
    for row in rows:
        assert row.kind == "reference" and row.op == "hash" and row.batch == 16
        assert row.gbps > 0 and row.extra["per_core_gbps"] > 0
    for module in ("crc32c", "blake3"):  # each optional candidate: rated, or named as skipped
        rated = any(r.target.startswith(module) for r in rows)
        named = any(line.startswith(f"{module}:") for line in skipped)
        assert rated != named, module
