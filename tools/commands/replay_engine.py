"""`kvtier replay --engine vllm|sim` and `kvtier replay --calibrate`: run, show, save.

Runs `tools.replay.experiment` under a rich progress bar (one phase per configuration),
prints the tables (`tools.replay.report.render`), writes the JSON report and the PNG plots
into `--out` (and `--json FILE` when given), and says where they are.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn)

from kvtier.tools.replay.experiment import EngineSpec, run_engine_replay
from kvtier.tools.replay.report import plot, render


class ProgressUI:
    """`say` and `phase` for the experiment, on one rich progress bar: `phase(desc, total)`
    adds a line (dropping lines already complete) and returns its `update(done)`."""

    def __init__(self, bar: Progress):
        self.bar = bar

    def say(self, msg: str) -> None:
        self.bar.console.print(f"[dim]{escape(msg)}[/]")

    def phase(self, desc: str, total: int):
        for t in list(self.bar.tasks):
            if t.finished:
                self.bar.remove_task(t.id)
        task = self.bar.add_task(desc, total=total)
        return lambda done: self.bar.update(task, completed=done)


def console() -> Console:
    return Console(width=max(Console().width, 170))  # wide tables stay readable in logs


def run_and_show(spec: EngineSpec, json_out: Path | None = None, plots: bool = True,
                 out: Console | None = None) -> dict:
    """Run the engine replay, print it, write the report and plots; returns the report."""
    out = out or console()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=out, transient=True) as bar:
        report = run_engine_replay(spec, ProgressUI(bar))
    render(report, out)
    spec.out.mkdir(parents=True, exist_ok=True)
    path = spec.out / f"replay-{spec.engine}.json"
    paths = [path] + ([json_out] if json_out else [])
    if plots:
        report["plots"] = [str(p) for p in plot(report, spec.out)]
    for p in paths:
        p.write_text(json.dumps(report, indent=2, default=str))
    out.print("report: " + ", ".join(str(p) for p in paths))
    if plots:
        out.print("plots: " + ", ".join(report["plots"]))
    return report


def calibrate_and_save(dtype: str, out_path: Path, out: Console | None = None) -> None:
    from kvtier.tools.replay.calibrate import calibrate
    out = out or console()
    cal = calibrate(dtype, say=lambda m: out.print(f"[dim]{escape(m)}[/]"))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cal.save(out_path)
    out.print(f"model: {cal.model.describe()}")
    out.print(f"wrote {out_path}; use it with --calibration {out_path}")
