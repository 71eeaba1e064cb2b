"""`kvtier bench vllm --peers`: the tables of kvtier beside other KV connectors."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvtier.tools.jsonout import write_report


def run_peers_command(peers: str, sizes: str, repeats: int, dtype: str, pool: str,
                      inproc: bool, dir: Optional[Path], json_out: Optional[Path],
                      decode: int = 0) -> None:
    """Run `tools.bench.peers` and print one table per statistic (median, min, p99)."""
    from kvtier.tools.bench.peers import PeersSpec, run_peers
    try:
        spec = PeersSpec(sizes=tuple(int(s) for s in sizes.split(",")), repeats=repeats,
                         peers=tuple(p.strip() for p in peers.split(",") if p.strip()),
                         dtype=dtype, pool=pool, inproc=inproc, decode_tokens=decode)
    except ValueError as e:
        hint = "--decode" if str(e).startswith("--decode") else "--peers"
        raise typer.BadParameter(str(e), param_hint=hint) from None
    console = Console(width=max(110, Console().width))
    with console.status("kvtier bench vllm --peers") as status:
        doc = run_peers(spec, dir, progress=lambda m: status.update(f"bench vllm --peers: {m}"))
    for name, why in doc["skipped"].items():
        console.print(f"  [yellow]skipped[/] {name}: {why}")
    steps = f"; decode: ms per step of {decode} tokens after the cold prefill" if decode else ""
    for stat in ("median", "min", "p99"):
        render(console, doc, stat, f"kvtier bench vllm --peers: TTFT in ms ({stat} of "
                                   f"{repeats}), tiny llama {dtype}, block 32, kvtier pool "
                                   f"{pool}{steps}")
    checked = sum(len(r["ttft_s"]) for r in doc["rows"] if "ttft_s" in r)
    if doc["mismatches"]:
        for m in doc["mismatches"]:
            console.print(f"  [red]output mismatch[/] {m}")
    else:
        console.print(f"  outputs: all {checked} token-identical to vLLM alone's")
    for m in doc["missed_hits"]:
        console.print(f"  [yellow]missed hit[/] {m}")
    if json_out is not None:
        write_report(doc, json_out)


def render(console: Console, doc: dict, stat: str, title: str) -> None:
    """Rows by size and case, a column per system, then kvtier's time over each other's."""
    from kvtier.tools.bench.peers import ROWS
    systems = doc["systems"]
    cell = {(r["system"], r["size"], r["case"]): r[f"{stat}_ms"] for r in doc["rows"]}
    others = [s for s in systems if s != "kvtier"] if "kvtier" in systems else []
    table = Table(title=title)
    for col in ("tokens", "case", *systems, *(f"kvtier / {s}" for s in others)):
        table.add_column(col, justify="right")
    for size in doc["spec"]["sizes"]:
        for case in ROWS:
            vals = [cell.get((s, size, case)) for s in systems]
            if not any(vals):
                continue
            mine = cell.get(("kvtier", size, case))
            ratios = [f"{mine / cell[s, size, case]:.2f}" if mine and cell.get((s, size, case))
                      else "-" for s in others]
            digits = 2 if case == "decode" else 1  # a step is a few ms
            table.add_row(str(size), case, *(f"{v:.{digits}f}" if v else "-" for v in vals),
                          *ratios)
    console.print(table)
