"""Rows, ratios, targets, the rich table and the JSON of `kvtier bench tiers`.

A `Row` is one (target, op, block size, batch) measurement: throughput in GB/s (1e9 bytes/s
of payload) of the median call, and the P50/P99 latency of one call (one batch). References
are rows too (raw Mooncake, fio). With `--repeat N` the rows of the runs are merged by median.
`ratio` is a row's throughput over its reference's; for the mooncake tier, `vs +verify` is
its throughput over raw Mooncake plus the frame verification every tier must do, i.e. what
the tier's own code costs beyond the contract's checksum.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table


TARGET_RATIO = 0.8
NVME_TARGET_MIN_BLOCK = 2 << 20


@dataclass
class Row:
    target: str          # e.g. "dram[zero-copy]", "nvme[uring]", "raw mooncake", "fio"
    kind: str            # tier kind, or "reference"
    op: str              # put / get (fio: write / read)
    block_bytes: int
    batch: int
    gbps: float
    p50_ms: float
    p99_ms: float
    calls: int = 0
    reference: str | None = None  # target name of the reference row
    ref_gbps: float | None = None
    ratio: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def case(self) -> tuple:
        return (self.op, self.block_bytes, self.batch)


def row_from_times(target: str, kind: str, op: str, block_bytes: int, batch: int,
                   times: list[float], **kw) -> Row:
    """Throughput of the median call (robust to calls slowed by other work on a shared
    machine); latency percentiles of single calls; the mean-based figure goes in extra."""
    ordered = sorted(times)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    nbytes = block_bytes * batch
    row = Row(target, kind, op, block_bytes, batch, gbps=nbytes / p50 / 1e9, p50_ms=p50 * 1e3,
              p99_ms=p99 * 1e3, calls=len(times), **kw)
    row.extra["mean_gbps"] = round(nbytes * len(times) / sum(times) / 1e9, 3)
    return row


def merge_runs(runs: list[list[Row]]) -> list[Row]:
    """One row per (target, case): the median of each number over the runs."""
    if len(runs) == 1:
        return runs[0]
    groups: dict[tuple, list[Row]] = {}
    for rows in runs:
        for row in rows:
            groups.setdefault((row.target, row.case), []).append(row)
    merged = []
    for rows in groups.values():
        first = rows[0]
        merged.append(Row(first.target, first.kind, first.op, first.block_bytes, first.batch,
                          gbps=statistics.median(r.gbps for r in rows),
                          p50_ms=statistics.median(r.p50_ms for r in rows),
                          p99_ms=statistics.median(r.p99_ms for r in rows),
                          calls=sum(r.calls for r in rows), reference=first.reference,
                          extra={**first.extra, "runs_gbps": [round(r.gbps, 3) for r in rows]}))
    return merged


def link_references(rows: list[Row], refs: list[Row]) -> None:
    """Fill ref_gbps and ratio of each row from the reference row it names."""
    by_key = {(r.target, r.case): r for r in refs}
    for row in rows:
        floor = by_key.get((f"{row.reference}+verify", row.case))
        if floor is not None and floor.gbps > 0:
            row.extra["vs_verify_floor"] = round(row.gbps / floor.gbps, 3)
        if row.reference is None:
            continue
        op = row.op if row.reference != "fio" else ("write" if row.op == "put" else "read")
        ref = by_key.get((row.reference, (op, row.block_bytes, row.extra.get("ref_batch",
                                                                          row.batch))))
        if ref is not None and ref.gbps > 0:
            row.ref_gbps, row.ratio = ref.gbps, row.gbps / ref.gbps


def check_targets(rows: list[Row]) -> list[dict]:
    """The issue's targets, each with the numbers it was judged on."""
    out = []
    for row in rows:
        if row.ratio is None:
            continue
        if row.kind == "mooncake" and row.extra.get("zero_copy"):
            what = f"{row.target} {row.op} >= 80% of raw Mooncake"
        elif (row.kind == "nvme" and row.extra.get("engine") == "uring"
              and row.block_bytes >= NVME_TARGET_MIN_BLOCK):
            what = f"{row.target} {row.op} >= 80% of fio"
        else:
            continue
        out.append(dict(target=what, block_bytes=row.block_bytes, batch=row.batch,
                        value=round(row.ratio, 3), met=row.ratio >= TARGET_RATIO))
    by_case = {(r.target, r.case): r for r in rows}
    for row in rows:
        if row.kind == "nvme" and row.extra.get("engine") == "uring" and row.batch > 1:
            other = by_case.get((row.target.replace("[uring]", "[psync]"), row.case))
            if other is not None and other.gbps > 0:
                out.append(dict(target=f"{row.target} {row.op} beats psync at queue depth > 1",
                                block_bytes=row.block_bytes, batch=row.batch,
                                value=round(row.gbps / other.gbps, 3),
                                met=row.gbps > other.gbps))
    return out


def render(rows: list[Row], refs: list[Row], targets: list[dict], console: Console) -> None:
    table = Table(title="kvtier bench tiers (GB/s: 1e9 payload bytes/s of the median call; "
                        "latency per call, fio: per I/O)")
    for col in ("target", "op", "block", "batch", "GB/s", "P50 ms", "P99 ms", "reference",
                "ref GB/s", "ratio", "vs +verify"):
        table.add_column(col, justify="left" if col in ("target", "op", "reference") else "right")
    for row in sorted(rows + refs, key=_order):
        ratio = "" if row.ratio is None else f"{row.ratio:.2f}"
        if row.ratio is not None and _judged(row):
            ratio = f"[{'green' if row.ratio >= TARGET_RATIO else 'red'}]{ratio}[/]"
        table.add_row(escape(row.target), row.op, size_label(row.block_bytes), str(row.batch),
                      f"{row.gbps:.2f}", f"{row.p50_ms:.2f}", f"{row.p99_ms:.2f}",
                      escape(row.reference or ""), "" if row.ref_gbps is None else f"{row.ref_gbps:.2f}",
                      ratio, _fmt(row.extra.get("vs_verify_floor")))
    console.print(table)
    met = sum(t["met"] for t in targets)
    console.print(f"targets met: {met} of {len(targets)}")
    for t in targets:
        if not t["met"]:
            console.print(f"  [red]missed[/]: {escape(t['target'])} at {size_label(t['block_bytes'])} "
                          f"x{t['batch']}: {t['value']:.2f}")


def markdown(rows: list[Row], refs: list[Row], targets: list[dict]) -> str:
    """The table and the targets as Markdown (for BENCHMARKS.md)."""
    head = ["target", "op", "block", "batch", "GB/s", "P50 ms", "P99 ms", "reference",
            "ref GB/s", "ratio", "vs +verify"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in sorted(rows + refs, key=_order):
        cells = [row.target, row.op, size_label(row.block_bytes), str(row.batch),
                 f"{row.gbps:.2f}", f"{row.p50_ms:.2f}", f"{row.p99_ms:.2f}",
                 row.reference or "", _fmt(row.ref_gbps), _fmt(row.ratio),
                 _fmt(row.extra.get("vs_verify_floor"))]
        if row.ratio is not None and _judged(row):
            cells[9] = f"**{cells[9]}**" if row.ratio >= TARGET_RATIO else f"{cells[9]} (missed)"
        lines.append("| " + " | ".join(cells) + " |")
    met = sum(t["met"] for t in targets)
    lines += ["", f"Targets met: {met} of {len(targets)}."]
    lines += [f"- missed: {t['target']} at {size_label(t['block_bytes'])} x{t['batch']}: "
              f"{t['value']:.2f}" for t in targets if not t["met"]]
    return "\n".join(lines) + "\n"


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def size_label(n: int) -> str:
    """256KiB, 2MiB, 16MiB (exact, unlike format_size's 2.0MiB)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def _judged(row: Row) -> bool:
    return (row.kind == "mooncake" and row.extra.get("zero_copy")) or (
        row.kind == "nvme" and row.extra.get("engine") == "uring"
        and row.block_bytes >= NVME_TARGET_MIN_BLOCK)


def _order(row: Row) -> tuple:
    return (row.kind == "reference", row.target, row.block_bytes, row.batch, row.op)


def machine_info() -> dict:
    return {"uname": " ".join(platform.uname()), "cores": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_json(path: Path, command: str, spec: dict, rows: Iterable[Row], refs: Iterable[Row],
               targets: list[dict], runs: int) -> None:
    doc = {"command": command, "machine": machine_info(), "spec": spec, "runs": runs,
           "results": [asdict(r) for r in rows], "references": [asdict(r) for r in refs],
           "targets": targets}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
