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
                                             "names or kinds to measure (`dram-files`: the "
                                             "pool lent from /dev/shm files, the README's "
                                             "setup); `verify`: the frame check and the "
                                             "candidate hashes"),
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


@app.command("failover")
def failover(kills: int = typer.Option(5, min=1, help="master kills per mode"),
             modes: str = typer.Option("ha,single", help="ha (etcd, leader and standby), "
                                       "single (one master restarted), or both"),
             json_out: Optional[Path] = typer.Option(None, "--json",
                                                     help="write the rows here")) -> None:
    """Seconds from a master kill to the pool's first working put and get, with HA masters
    (the leader killed, a standby takes over) and with one master killed and restarted;
    needs `etcd` (apt-get install etcd-server) for `ha`."""
    import json

    from kvtier.tools.bench import failover as bench_failover

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    if not chosen or set(chosen) - set(bench_failover.MEASURES):
        raise typer.BadParameter(f"expected ha, single or both, got {modes!r}",
                                 param_hint="--modes")
    result = bench_failover.run(kills, chosen)
    console = Console()
    for row in result["rows"]:
        console.print(f"{row['mode']:>6} kill {row['kill']}: first put {_secs(row['put_s'])} s, "
                      f"get {_secs(row['get_s'])} s; old blocks kept {row['old_kept']} of "
                      f"{row['old']}")
    for mode, st in result["summary"].items():
        console.print(f"[bold]{mode}[/bold]: {st['recovered']} of {st['kills']} kills "
                      f"recovered; first put median {_secs(st['put_s_median'])} s (max "
                      f"{_secs(st['put_s_max'])}), first get median {_secs(st['get_s_median'])} s "
                      f"(max {_secs(st['get_s_max'])}); old blocks kept {st['old_kept']}")
    if json_out is not None:
        command = "kvtier " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        json_out.write_text(json.dumps({"command": command, **result}, indent=1) + "\n")


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}"


# The connector's benchmarks live in `commands.bench_vllm` (owned with the connector).
from kvtier.tools.commands import bench_vllm as cli_bench_vllm  # noqa: E402

app.command("vllm")(cli_bench_vllm.vllm)
app.command("serve")(cli_bench_vllm.serve)
app.command("gather", context_settings=cli_bench_vllm.GATHER_SETTINGS)(cli_bench_vllm.gather)
