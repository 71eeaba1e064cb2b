"""The demo's report explains itself: two pool sizes make its DRAM plot a curve, every plot
has labelled axes and more than one point per series, the header's scale is the run's, and
each target's note says what bounds it in the run. Run on the simulated engine (the demo's
configuration): the plots are drawn from the report alike."""

from __future__ import annotations

import pytest

from kvtier.tools.commands.demo import DEMO_DRAM, demo_spec
from kvtier.tools.replay.experiment import run_engine_replay
from kvtier.tools.replay.report import figures, plot, render


class _UI:
    def say(self, msg):
        pass

    def phase(self, desc, total):
        return lambda done: None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    spec = demo_spec(engine="sim", speed=50.0, out=tmp_path_factory.mktemp("demo"))
    return run_engine_replay(spec, _UI())


def test_the_demo_runs_two_pool_sizes_and_reports_its_own_scale(report):
    run = report["runs"][-1]
    kinds = sorted(c["dram_frac"] for c in run["configs"].values() if c["kind"] == "kvtier")
    assert kinds == sorted(DEMO_DRAM)
    assert run["scale"] == pytest.approx(0.15)
    assert 0 < run["reuse_bound_pct"] < 100


def test_every_plot_has_labelled_axes_and_curves_not_dots(report, tmp_path):
    figs = figures(report)
    assert {name for name, _ in figs} >= {"per_turn_n4.png", "hit_vs_dram_n4.png"}
    for name, fig in figs:
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), name
            series = [ln for ln in ax.get_lines() if ln.get_marker() not in (None, "None", "")]
            assert series, name
            for ln in series:
                assert len(ln.get_xdata()) > 1, (name, ln.get_label())
                assert ln.get_label() and not ln.get_label().startswith("_"), name
            for tick in ax.get_yticklabels():
                assert "times" not in tick.get_text() and "^" not in tick.get_text(), name
    paths = plot(report, tmp_path)
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_the_tables_explain_the_configurations_and_the_targets(report):
    from rich.console import Console
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    assert "local: each vLLM instance's own prefix cache only, no kvtier" in text
    assert "an infinite cache would hit" in text
    assert "scale 0.15" in text
    notes = [t["note"] for t in report["targets"]]
    assert notes and all(notes), report["targets"]


def test_tokens_promised_then_recomputed_are_said_under_the_table(report):
    """A run whose loads fell short says how much was promised and recomputed, and how much
    was found and recomputed as faster; a run with none says nothing of it."""
    import copy

    from rich.console import Console
    shown = copy.deepcopy(report)
    label, cfg = next(iter(shown["runs"][-1]["configs"].items()))
    cfg["overall"].update(recomputed_pct=1.25, declined_pct=0.5)
    console = Console(record=True, width=200)
    render(shown, console)
    text = console.export_text()
    assert (f"{label}: 1.25% of input tokens promised by a lookup and then recomputed"
            in text) and "0.50% found and recomputed as faster than loading" in text
    for run in shown["runs"]:
        for c in run["configs"].values():
            c["overall"].update(recomputed_pct=0.0, declined_pct=0.0)
    console = Console(record=True, width=200)
    render(shown, console)
    assert "promised by a lookup" not in console.export_text()
