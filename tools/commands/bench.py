"""`kvtier bench ...`: measurements that compare kvtier with the limits of its backends."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvtier.store.base.units import parse_size

app = typer.Typer(rich_markup_mode=None, add_completion=False, no_args_is_help=True,
                  help="Benchmarks against the physical references (fio, raw Mooncake).")


@app.command("tiers")
def tiers(policy: Optional[Path] = typer.Option(None, "--policy", "-p",
                                                help="policy YAML (default: bench tiers "
                                                     "under --dir, embedded master)"),
          dir: Optional[Path] = typer.Option(None, "--dir", help="where the default tiers "
                                             "live (default: a temp dir)"),
          json_out: Optional[Path] = typer.Option(None, "--json", help="write the numbers here"),
          markdown: Optional[Path] = typer.Option(None, "--markdown",
                                                  help="write the table as Markdown here"),
          quick: bool = typer.Option(False, "--quick", help="small batches, fewer rounds"),
          only: Optional[str] = typer.Option(None, "--tiers", help="comma-separated tier "
                                             "names or kinds to measure"),
          sizes: Optional[str] = typer.Option(None, help="block sizes, e.g. 256KiB,2MiB"),
          batches: Optional[str] = typer.Option(None, help="batch sizes, e.g. 1,64"),
          repeat: int = typer.Option(1, min=1, help="run N times, report medians"),
          fio: bool = typer.Option(True, "--fio/--no-fio", help="measure the fio reference")
          ) -> None:
    """Put/get throughput and P50/P99 latency of every tier, beside fio and raw Mooncake."""
    from kvtier.tools.bench import report as bench_report
    from kvtier.tools.bench import tiers as bench_tiers

    spec = bench_tiers.with_options(
        bench_tiers.QUICK if quick else bench_tiers.FULL,
        [parse_size(s) for s in sizes.split(",")] if sizes else None,
        [int(b) for b in batches.split(",")] if batches else None, fio)
    names = set(only.split(",")) if only else None
    load_start = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared
    rows, refs, targets = bench_tiers.run_bench(spec, policy, dir, names, repeat)
    bench_report.render(rows, refs, targets, Console(width=max(150, Console().width)))
    if markdown is not None:
        markdown.write_text(bench_report.markdown(rows, refs, targets))
    if json_out is not None:
        command = "kvtier " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        bench_report.write_json(json_out, command, {**bench_tiers.spec_dict(spec),
                                                    "loadavg_start": load_start},
                                rows, refs, targets, repeat)


# The connector's benchmarks live in `commands.bench_vllm` (owned with the connector).
from kvtier.tools.commands import bench_vllm as cli_bench_vllm  # noqa: E402

app.command("vllm")(cli_bench_vllm.vllm)
app.command("gather", context_settings=cli_bench_vllm.GATHER_SETTINGS)(cli_bench_vllm.gather)
