"""Tables and plots of an engine replay's report (`tools.replay.experiment`).

`render(report, console)`: per instance count, the comparison of the configurations (hit
rate overall and per tier, TTFT and end-to-end P50/P99, throughput, bytes read per tier and
saved), the ratios against the local-only baseline, hit rate and TTFT per turn; then the
scaling sweep and the targets. `plot(report, out_dir)`: PNGs of hit rate and TTFT per turn,
hit rate against DRAM size, and (sweeps) hit rate and throughput against instances.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvtier.tools.replay.cluster import PEERS
from kvtier.tools.replay.metrics import ratios

MiB = 1 << 20


# What each kind of configuration is, for the tables' footnotes and the plots' legends.
KINDS = {"kvtier": ("pool + disk tiers", "the DRAM pool, then nvme and the shared dir"),
         "dram-only": ("pool only", "the DRAM pool alone, no disk tier"),
         "local": ("no kvtier", "each vLLM instance's own prefix cache only, no kvtier"),
         "mooncake-store": ("vLLM's MooncakeStoreConnector",
                            "vLLM's own Mooncake store connector (standalone-store: a pool of "
                            "the same size, over TCP); vLLM reports its hits with the local "
                            "prefix cache's, so its hit % has no local split"),
         "mooncake-store+ssd": ("MooncakeStoreConnector + Mooncake's SSD offload",
                                "the same with Mooncake's own SSD tier under the pool (every "
                                "object also written to a disk of kvtier's disk tiers' size, "
                                "read from there once the pool dropped it)"),
         "lmcache": ("LMCache",
                     "LMCacheMPConnector and one lmcache server whose L1 is the pool's size, "
                     "the engines multi-process (make peers); its hit % has no local split")}


def legend(label: str, c: dict) -> str:
    """A plot's name for configuration `label`: the label and what it is."""
    return f"{label} ({KINDS.get(c['kind'], (c['kind'], ''))[0]})"


# How kvtier's engines shared the pool (`--pool`), for the footnote.
POOL_KINDS = {"files": "each engine lends its share from a /dev/shm file the others copy from",
              "service": "the engines join one pool service through shared memory",
              "embedded": "each engine lends its share over TCP"}


def _footnote(run: dict) -> str:
    kinds = {c["kind"] for c in run["configs"].values()}
    pools = sorted({c["pool"] for c in run["configs"].values() if c.get("pool")})
    lines = [f"  {k}: {KINDS[k][1]}" + (" (DRAM pool: % of the working set, the bytes "
                                         "of every distinct block)" if k == "kvtier" else "")
             for k in KINDS if k in kinds]
    lines += [f"  kvtier's pool ({p}): {POOL_KINDS.get(p, p)}" for p in pools]
    return "\n".join(lines)


def _ms(s: float | None) -> str:
    return "" if s is None else f"{s * 1e3:,.0f}"


def render(report: dict, console: Console) -> None:
    spec = report["spec"]
    for run in report["runs"]:
        o = next(iter(run["configs"].values()))["overall"]
        console.print(
            f"[bold]{spec['engine']} engines[/]: {run['instances']} instances, "
            f"{spec['router']}, {run['plan']} ({run['requests']} requests, scale "
            f"{run['scale']:g}); KV cache {run['kv_tokens']:,} tokens per instance, live "
            f"contexts {o['kv_ratio']:.1f}x it; working set "
            f"{run['working_set_bytes'] / MiB:,.0f} MiB")
        console.print(_compare(run))
        console.print(_footnote(run))
        for label, c in run["configs"].items():
            lost, declined = (c["overall"].get(k) or 0 for k in ("recomputed_pct",
                                                                  "declined_pct"))
            if lost or declined:
                console.print(f"  {label}: {lost:.2f}% of input tokens promised by a lookup "
                              "and then recomputed (a load that failed or passed its "
                              f"deadline), {declined:.2f}% found and recomputed as faster "
                              "than loading")
            split = c.get("pool_hits_by_host")
            if split:
                total = max(1, split["same"] + split["cross"])
                console.print(f"  {label}: pool blocks loaded from a lender on the same host "
                              f"{split['same']:,}, on another host {split['cross']:,} "
                              f"({100 * split['cross'] / total:.0f}% cross-host, "
                              f"{spec.get('hosts', 1)} hosts)")
        if "local" in run["configs"]:
            for label, c in run["configs"].items():
                if c["kind"] != "local":
                    r = ratios(run["configs"], "local", label)
                    console.print(f"  {label} vs local: TTFT P50 {r['ttft_p50_lower_x']:.1f}x "
                                  f"lower, throughput {r['throughput_higher_x']:.2f}x higher, "
                                  f"end-to-end P50 {r['e2e_p50_lower_x']:.1f}x lower")
        console.print(_per_turn(run))
    if len(report["runs"]) > 1:
        console.print(_sweep(report["runs"]))
    console.print(_targets(report["targets"]))
    model = next((c.get("model") for r in report["runs"] for c in r["configs"].values()
                  if c.get("model")), None)
    if model:
        console.print(f"modeled times (virtual seconds): {model}")
    console.print(f"{report['date']}, {report['machine']}, {report['wall_s']:.0f} s")


def _compare(run: dict) -> Table:
    names = sorted({t for c in run["configs"].values() for t in c["tiers"]},
                   key=["dram", "nvme", "shared"].index)
    t = Table(title="configurations: hit rates (% of input tokens), times (ms), throughput, "
              "MiB read from each tier / saved")
    cols = ["config", "DRAM pool", "hit %", "local %", *[f"{n} %" for n in names],
            "TTFT P50", "P99", "E2E P50", "P99", "tok/s", f"read {'/'.join(names)}", "saved"]
    for col in cols:
        t.add_column(col, justify="right", no_wrap=col == "config")
    for label, c in run["configs"].items():
        o = c["overall"]
        dram = "" if c["dram_frac"] is None else \
            f"{100 * c['dram_frac']:g}%={c['segment_bytes'] * run['instances'] / MiB:,.0f}M"
        read = "/".join(f"{o['bytes_read'][n] / MiB:,.0f}" if n in c["tiers"] else "-"
                        for n in names)
        local = "" if c["kind"] in PEERS else f"{o['hit_by_tier']['local']:.1f}"
        t.add_row(label, dram, f"{o['hit_rate']:.1f}", local,
                  *[f"{o['hit_by_tier'].get(n, 0):.1f}" if n in c["tiers"] else ""
                    for n in names],
                  _ms(o["ttft_p50_s"]), _ms(o["ttft_p99_s"]), _ms(o["e2e_p50_s"]),
                  _ms(o["e2e_p99_s"]), f"{o['throughput_tps']:,.0f}", read if names else "",
                  f"{o['bytes_saved'] / MiB:,.0f}" if c["tiers"] else "")
    return t


def _per_turn(run: dict) -> Table:
    t = Table(title="per turn: hit % / TTFT P50 ms")
    t.add_column("turn", justify="right")
    labels = list(run["configs"])
    for label in labels:
        t.add_column(label, justify="right")
    turns = max(len(c["per_turn"]) for c in run["configs"].values())
    for j in range(turns):
        cells = []
        for label in labels:
            rows = run["configs"][label]["per_turn"]
            cells.append(f"{rows[j]['hit_rate']:.1f} / {_ms(rows[j]['ttft_p50_s'])}"
                         if j < len(rows) else "")
        t.add_row(str(j + 1), *cells)
    return t


def _sweep(runs: list[dict]) -> Table:
    labels = list(runs[0]["configs"])
    t = Table(title="instances sweep (sessions scaled alongside): hit % / tok/s")
    for col in ("instances", "sessions", *labels):
        t.add_column(col, justify="right")
    for run in runs:
        t.add_row(str(run["instances"]), str(run["sessions"]),
                  *[f"{run['configs'][lab]['overall']['hit_rate']:.1f} / "
                    f"{run['configs'][lab]['overall']['throughput_tps']:,.0f}"
                    for lab in labels])
    return t


def _targets(targets: list[dict]) -> Table:
    t = Table(title="targets of the main job, each against configurations of the same run")
    for col in ("instances", "what", "value", "target", "met", "note"):
        t.add_column(col, justify="right" if col in ("instances", "value") else "left")
    for x in targets:
        t.add_row(str(x["instances"]), x["what"], f"{x['value']:g}", x["target"],
                  "[green]yes[/]" if x["ok"] else "[red]no[/]", x["note"])
    return t


def figures(report: dict) -> list[tuple[str, object]]:
    """(file name, matplotlib figure) of each plot of the report."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    run = report["runs"][-1]
    out = [_per_turn_plot(plt, run), _dram_plot(plt, run)]
    if len(report["runs"]) > 1:
        out.append(_sweep_plot(plt, report["runs"]))
    return out


def plot(report: dict, out_dir: Path) -> list[Path]:
    """Write the PNGs; returns their paths."""
    import matplotlib.pyplot as plt
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures(report):
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def _per_turn_plot(plt, run: dict) -> tuple[str, object]:
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, c in run["configs"].items():
        turns = [r["turn"] for r in c["per_turn"]]
        a.plot(turns, [r["hit_rate"] for r in c["per_turn"]], marker="o", ms=3,
               label=legend(label, c))
        b.plot(turns, [r["ttft_p50_s"] * 1e3 for r in c["per_turn"]], marker="o", ms=3,
               label=legend(label, c))
    a.set(xlabel="turn", ylabel="token hit rate %", ylim=(0, 100), title="hit rate per turn")
    b.set(xlabel="turn", ylabel="TTFT P50 (ms, log scale)", yscale="log",
          title="time to first token per turn")
    _plain_ticks(b.yaxis)
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.suptitle(f"{run['instances']} instances, {run['plan']} (scale {run['scale']:g})")
    fig.tight_layout()
    return f"per_turn_n{run['instances']}.png", fig


def _dram_plot(plt, run: dict) -> tuple[str, object]:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for kind in ("kvtier", "dram-only", *PEERS):
        pts = sorted((c["dram_frac"] * 100, c["overall"]["hit_rate"])
                     for c in run["configs"].values() if c["kind"] == kind)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{kind}: {KINDS[kind][1]}")
    local = next((c for c in run["configs"].values() if c["kind"] == "local"), None)
    if local:
        ax.axhline(local["overall"]["hit_rate"], ls="--", c="gray",
                   label="local: vLLM's own prefix cache only")
    if run.get("reuse_bound_pct") is not None:
        ax.axhline(run["reuse_bound_pct"], ls=":", c="black",
                   label="an infinite cache (what this workload reuses)")
    top = max([100.0] + [100 * c["dram_frac"] for c in run["configs"].values()
                         if c["dram_frac"] is not None])
    ax.set(xlabel="DRAM pool, % of the working set (every distinct block)",
           ylabel="token hit rate %", xlim=(0, top * 1.05), ylim=(0, 100),
           title="hit rate against the DRAM pool's size")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return f"hit_vs_dram_n{run['instances']}.png", fig


def _plain_ticks(axis) -> None:
    """Log-axis ticks as plain numbers (600, not 6x10^2)."""
    from matplotlib.ticker import FuncFormatter, LogLocator
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_locator(LogLocator(subs=(1.5, 2, 3, 5, 7)))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _sweep_plot(plt, runs: list[dict]) -> tuple[str, object]:
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    ns = [r["instances"] for r in runs]
    for label, c in runs[0]["configs"].items():
        o = [r["configs"][label]["overall"] for r in runs]
        a.plot(ns, [x["hit_rate"] for x in o], marker="o", label=legend(label, c))
        b.plot(ns, [x["throughput_tps"] for x in o], marker="o", label=legend(label, c))
    first = runs[0]["configs"][next(iter(runs[0]["configs"]))]["overall"]["throughput_tps"]
    b.plot(ns, [first * n / ns[0] for n in ns], ls="--", c="gray", label="linear")
    a.set(xlabel="instances", ylabel="token hit rate %", ylim=(0, 100), xscale="log")
    b.set(xlabel="instances", ylabel="throughput (tokens/s, log scale)", xscale="log",
          yscale="log")
    for axis in (a.xaxis, b.xaxis, b.yaxis):
        _plain_ticks(axis)
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    return "scaling.png", fig
