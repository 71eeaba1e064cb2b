"""fio as the disk reference of `kvtier bench tiers`: io_uring, O_DIRECT, one job.

`run_fio(directory, rw, block_bytes, iodepth, size_bytes)` runs one fio job on a file in
`directory` (the filesystem of the tier it is compared with) and returns its bandwidth and
per-I/O completion latency parsed from `--output-format=json`. A write job lays the file out;
the read job that follows reads it back, so run "write" before "read" for one file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvtier.store.base.errors import KVTierError

FIO_FILE = "kvtier-fio.dat"


@dataclass(frozen=True)
class FioResult:
    rw: str
    block_bytes: int
    iodepth: int
    gbps: float      # 1e9 bytes per second
    p50_ms: float    # per I/O completion latency
    p99_ms: float
    size_bytes: int


def fio_available() -> bool:
    return shutil.which("fio") is not None


def fio_command(path: Path, rw: str, block_bytes: int, iodepth: int, size_bytes: int,
                runtime_s: int = 30) -> list[str]:
    return ["fio", "--name=kvtier-ref", f"--filename={path}", "--ioengine=io_uring",
            "--direct=1", f"--rw={rw}", f"--bs={block_bytes}", f"--iodepth={iodepth}",
            f"--size={size_bytes}", "--numjobs=1", f"--runtime={runtime_s}",
            "--output-format=json"]


def run_fio(directory: Path, rw: str, block_bytes: int, iodepth: int,
            size_bytes: int) -> FioResult:
    """One fio job; raises KVTierError naming the fix when fio is missing or fails."""
    if not fio_available():
        raise KVTierError("fio not found; install it (apt-get install fio) or pass --no-fio")
    directory.mkdir(parents=True, exist_ok=True)
    cmd = fio_command(directory / FIO_FILE, rw, block_bytes, iodepth, size_bytes)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise KVTierError(f"fio {rw} bs={block_bytes} in {directory} failed: {tail[0]}; "
                          "check that the filesystem supports O_DIRECT, or pass --no-fio")
    return parse_fio(proc.stdout, rw, block_bytes, iodepth, size_bytes)


def parse_fio(text: str, rw: str, block_bytes: int, iodepth: int, size_bytes: int) -> FioResult:
    """Bandwidth and clat percentiles of the first job of fio's JSON output."""
    start = text.find("{")  # fio may print notes before the JSON document
    job = json.loads(text[start:])["jobs"][0]
    side = job["read" if "read" in rw else "write"]
    pct = side.get("clat_ns", {}).get("percentile", {})
    return FioResult(rw=rw, block_bytes=block_bytes, iodepth=iodepth,
                     gbps=side["bw_bytes"] / 1e9,
                     p50_ms=pct.get("50.000000", 0) / 1e6, p99_ms=pct.get("99.000000", 0) / 1e6,
                     size_bytes=size_bytes)


def remove_fio_file(directory: Path) -> None:
    (directory / FIO_FILE).unlink(missing_ok=True)
