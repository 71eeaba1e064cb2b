"""`kvtier replay --engine sim --soak MINUTES`: run the soak (`tools.replay.soak.run`) under a
rich progress bar, print its tables, write `OUT/replay-soak.json` (and `--json FILE`), and
return the exit code: 0 when the soak is `ok`, 1 otherwise (wrong blocks, failed requests,
a check not clean, a master restart the pool did not recover from in time).
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.tools.replay.soak.run import SoakSpec, run_soak


class SoakUI:
    """`say(msg)` above the bar, `progress(elapsed_s)` on it."""

    def __init__(self, bar: Progress, total_s: float):
        self.bar = bar
        self.task = bar.add_task("soak", total=total_s)

    def say(self, msg: str) -> None:
        self.bar.console.print(f"[dim]{escape(msg)}[/]")

    def progress(self, elapsed_s: float) -> None:
        self.bar.update(self.task, completed=elapsed_s)


def run_and_show_soak(spec: SoakSpec, json_out: Path | None = None,
                      out: Console | None = None) -> int:
    out = out or Console(width=max(Console().width, 130))
    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed:.0f}/{task.total:.0f} s"), TimeElapsedColumn(),
                  console=out, transient=True) as bar:
        rep = run_soak(spec, SoakUI(bar, spec.seconds))
    render(rep, out)
    spec.engine.out.mkdir(parents=True, exist_ok=True)
    paths = [spec.engine.out / "replay-soak.json"] + ([json_out] if json_out else [])
    for p in paths:
        p.write_text(json.dumps(rep, indent=2, default=str))
    out.print("report: " + ", ".join(str(p) for p in paths))
    return 0 if rep["ok"] else 1


def render(rep: dict, out: Console) -> None:
    spec = rep["spec"]
    verdict = "[green]ok[/]" if rep["ok"] else f"[red]NOT OK: {'; '.join(rep['why_not'])}[/]"
    t = Table(title=f"soak: {rep['instances']} instances, {spec['soak_s'] / 60:g} min, a "
              f"fault every {spec['fault_every_s']:g} s, {rep['repetitions']} repetitions "
              f"of {rep['plan_requests']} requests: {verdict}")
    t.add_column("what")
    t.add_column("count", justify="right")
    for row in summary_rows(rep):
        t.add_row(*row)
    out.print(t)
    render_intervals(rep, out)
    if rep["failures"]:
        out.print("[red]failures:[/]\n" + "\n".join(escape(f) for f in rep["failures"]))
    out.print(f"{rep['date']}, {rep['machine']}, {rep['wall_s']:.0f} s")


def summary_rows(rep: dict) -> list[tuple[str, str]]:
    rows = [(f"fault {kind}", f"{c['injected']}" + (f" (+{c['skipped']} skipped)"
                                                    if c["skipped"] else ""))
            for kind, c in rep["faults"].items()]
    rows += [(f"requests {k.replace('_', ' ')}", str(v)) for k, v in rep["requests"].items()]
    rows += [(f"instances {k}", str(v)) for k, v in rep["instance_deaths"].items()]
    rows += [("wrong blocks served", str(rep["wrong_blocks"])),
             ("frames corrupted (shared / nvme)",
              f"{rep['corrupted']['shared']} / {rep['corrupted']['nvme']}"),
             ("corrupt blocks detected (quarantined)",
              ", ".join(f"{k} {v}" for k, v in rep["corrupt_detected"].items()) or "0")]
    rows += [(f"corrupted {tier} read back at the end: still held / corrupt / wrong",
              f"{rb.get('held', 0)} / {rb.get('corrupt', 0)} / {rb.get('wrong', 0)}")
             for tier, rb in rep["read_back"].items()]
    mv, m, ck = rep["mover"], rep["master"], rep["check"]
    rows += [("mover: failed copies (full disk, pool gone) / puts into a full tier / tier "
              "errors absorbed", f"{mv.get('copy_errors', 0)} / "
              f"{sum(v for k, v in mv.items() if k.startswith('full_'))} / "
              f"{mv.get('errors', 0)}"),
             ("master restarts: pool hits again after (max / median s)",
              f"{m['restarts']}: {_s(m['max_s'])} / {_s(m['median_s'])}"
              + (f", unrecovered {m['unrecovered_s']}" if m["unrecovered_s"] else "")),
             ("inspect check at the end", "clean" if ck["clean"] else
              f"[red]{ck['problems_by_kind'] or 'unchecked tiers'}[/]"),
             ("token hit rate %", _s(rep["hit_pct"]))]
    return rows


def render_intervals(rep: dict, out: Console) -> None:
    t = Table(title="per interval (the fault named is injected at its start)")
    for col in ("from s", "fault", "requests", "hit %", "kvtier hit %", "dram", "nvme",
                "shared", "failed", "retried", "wrong"):
        t.add_column(col, justify="left" if col == "fault" else "right")
    for iv in rep["intervals"]:
        b = iv["blocks_from"]
        t.add_row(f"{iv['from_s']:g}", iv["fault"] or "", str(iv["requests"]),
                  _s(iv["hit_pct"]), _s(iv["kvtier_hit_pct"]), str(b["dram"]), str(b["nvme"]),
                  str(b["shared"]), str(iv["failed"]), str(iv["retried"]), str(iv["wrong"]))
    out.print(t)


def _s(v) -> str:
    return "-" if v is None else f"{v:g}"
