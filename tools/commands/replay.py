"""`kvtier replay`: replay traces against policies.

`--simulate` is the policy-only replay (`tools.policysim.experiment`): token hit rate of every
policy at every capacity against `belady` and an infinite cache, plus the tiered variant, as
rich tables and `--json FILE`. `--engine vllm|sim` replays one workload through N engines on a
kvtier cluster against the baselines (`tools.replay.experiment`, shown by
`tools.commands.replay_engine`); `--calibrate` measures the real tiny engine for the sim's
prefill model. `--engine sim --soak MINUTES` replays under injected faults and verifies what was
served (`tools.commands.replay_soak`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from kvtier.store.base.errors import KVTierError
from kvtier.tools.policysim.experiment import BOUND, CLASSIC, ORACLE, RunSpec, run
from kvtier.tools.policysim.replay import SimParams
from kvtier.tools.workload.synthetic import SyntheticSpec

WORKLOADS = ("synthetic", "weka", "conversation")
GENERATED = ("forks", "chat", "rag")   # `tools.workload.generators`, simulate only


class ReplayError(KVTierError):
    """A replay option is invalid or the mode is not available."""


def _floats(text: str, what: str, n: int | None = None,
            zero_ok: bool = False) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ReplayError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    low_ok = (lambda v: v >= 0) if zero_ok else (lambda v: v > 0)
    if not vals or not all(map(low_ok, vals)) or (n is not None and len(vals) != n):
        want = f"{n} " if n else ""
        sign = "non-negative" if zero_ok else "positive"
        raise ReplayError(f"{what}: expected {want}{sign} comma-separated numbers, "
                          f"got {text!r}")
    return vals


def _workloads(names: list[str]) -> tuple[str, ...]:
    bad = [w for w in names if w not in WORKLOADS + GENERATED]
    if bad:
        raise ReplayError(f"unknown workload {bad[0]!r}; known: "
                          f"{', '.join(WORKLOADS + GENERATED)}")
    return tuple(dict.fromkeys(names))


def _traced(workloads: tuple[str, ...], traces: Path) -> tuple[str, ...]:
    """`workloads`, once the traces they replay are known to be under `traces`."""
    from kvtier.tools.workload.traces import TRACE_FILES
    for w in workloads:
        path = traces / TRACE_FILES.get(w, "")
        if w in TRACE_FILES and not path.exists():
            where = "" if traces.is_absolute() else f" (from {Path.cwd()})"
            raise ReplayError(f"{path}: not found{where}, the {w} trace; pass --traces (or "
                              f"set KVTIER_TRACES) to the folder that holds "
                              f"{TRACE_FILES[w]}, or choose other workloads with -w")
    return workloads


def _one_workload(names: list[str]) -> str:
    """Engine replay takes one workload; with none chosen (all three), the synthetic one."""
    if list(names) == list(WORKLOADS):
        return "synthetic"
    wl = _workloads(names)
    if len(wl) != 1:
        raise ReplayError(f"--engine replays one workload at a time, got {', '.join(wl)}")
    if wl[0] not in WORKLOADS:
        raise ReplayError(f"--engine replays {', '.join(WORKLOADS)}; {wl[0]} is for --simulate")
    return wl[0]


def _gap_classes(text: str) -> str:
    from kvtier.tools.workload.traces import GAP_CLASS_MODES
    if text not in GAP_CLASS_MODES:
        raise ReplayError(f"--gap-classes: expected one of {', '.join(GAP_CLASS_MODES)}, "
                          f"got {text!r}")
    return text


def _policies(text: str) -> tuple[str, ...]:
    from kvtier.eviction import EVICTION_POLICIES
    pols = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in pols if p.removesuffix("+select") not in EVICTION_POLICIES
               or p == "belady" or (p.endswith("+select") and p != "agentic+select")]
    if unknown or not pols:
        raise ReplayError(f"unknown or implicit policy {(unknown or [text])[0]!r}; choose "
                          f"from {', '.join(k for k in EVICTION_POLICIES if k != 'belady')}, "
                          "agentic+select (belady and the infinite cache always run)")
    return pols


def replay(
    simulate: bool = typer.Option(False, "--simulate", help="policy-only replay, no bytes moved"),
    engine: Optional[str] = typer.Option(None, help="replay through engines: vllm (real) | "
                                         "sim (simulated, real store)"),
    workload: list[str] = typer.Option(list(WORKLOADS), "--workload", "-w",
                                       help="synthetic | weka | conversation, or generated "
                                       "(simulate): forks | chat | rag (repeatable)"),
    policies: str = typer.Option("lru,s3fifo,arc,agentic", help="policies besides belady"),
    capacities: str = typer.Option("0.005,0.01,0.02,0.05,0.1,0.2,0.4",
                                   help="capacities as fractions of the unique footprint"),
    tiered: str = typer.Option("0.005,0.05,1.0", help="dram,nvme,sharedfs fractions for the "
                               "tiered variant ('none' to skip)"),
    traces: Path = typer.Option(Path(os.environ.get("KVTIER_TRACES", "../shared/traces")),
                                help="folder with weka_cc_traces/ and conversation_trace.jsonl"),
    sessions: Optional[int] = typer.Option(None, min=1, help="sessions (simulate default 64; "
                                           "engines default 8, per instance in a sweep)"),
    live: int = typer.Option(0, min=0, help="synthetic: sessions in progress at once "
                             "(0: all)"),
    weka_live: int = typer.Option(32, min=1, help="weka: sessions in progress at once"),
    seed: int = typer.Option(0, help="seed of the synthetic and generated workloads and the "
                             "weka order"),
    bytes_per_token: int = typer.Option(131_072, min=1, help="KV bytes per token"),
    prefill_tps: float = typer.Option(20_000.0, min=1.0, help="prefill tokens per second"),
    jobs: int = typer.Option(min(2, os.cpu_count() or 1), min=1, help="worker processes"),
    online_bound: bool = typer.Option(False, "--online-bound", help="simulate: add an upper "
                                      "bound on the hit rate any online policy can reach on "
                                      "synthetic (about 80 s per capacity)"),
    gap_oracle: str = typer.Option("", "--gap-oracle", help="simulate: add agentic told each "
                                   "turn's true next gap, with a log-normal error of each of "
                                   "these sigmas (e.g. 0,0.5,1; 0: exact), on synthetic and "
                                   "weka: columns 'told ±SIGMA'"),
    gap_classes: str = typer.Option("trace", "--gap-classes", help="simulate: what each "
                                    "turn's end tells of the wait: trace (the stop reason "
                                    "and output types) | tool-user | none"),
    time_scale: float = typer.Option(1.0, "--time-scale", min=1e-3, max=1e3,
                                     help="simulate: multiply arrival times (0.1 compresses "
                                     "a trace 10x, 10 stretches it)"),
    population: int = typer.Option(1, "--population", min=1, max=1000,
                                   help="simulate: the generated workloads (forks, chat, "
                                   "rag) with this many times the sessions over the same "
                                   "time: a bigger node"),
    gap_info: bool = typer.Option(False, "--gap-info", help="simulate: add how much of "
                                  "each workload's gaps what a server knows at a turn's "
                                  "end explains, as the --gap-oracle sigma it equals"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the results here"),
    instances: str = typer.Option("4", help="engines: instance counts (a list sweeps, with "
                                  "--sessions per instance)"),
    router: str = typer.Option("round-robin", help="engines: round-robin | session-sticky | "
                               "least-loaded"),
    turns: int = typer.Option(30, min=1, help="engines: turns per session (at most)"),
    scale: float = typer.Option(0.1, min=0.001, help="engines: real tokens per workload token"),
    speed: float = typer.Option(1.0, min=0.001, help="engines: time runs this much faster"),
    dram: str = typer.Option("1.5", help="engines: DRAM pool sizes as fractions of the "
                             "working set (comma-separated)"),
    baselines: str = typer.Option("local,dram-only", help="engines: baselines to run too, of "
                                  "local, dram-only and the peers mooncake-store (vLLM's "
                                  "MooncakeStoreConnector), mooncake-store+ssd (the same "
                                  "with Mooncake's SSD offload) and lmcache (make peers), "
                                  "--engine vllm"),
    kv_ratio: float = typer.Option(4.0, min=0.1, help="engines: live contexts / KV cache"),
    kv_tokens: int = typer.Option(0, min=0, help="engines: KV cache tokens per instance "
                                  "(0: from --kv-ratio)"),
    max_output: int = typer.Option(32, min=1, help="engines: most tokens generated"),
    max_context: int = typer.Option(16384, min=64, help="engines: longest prompt"),
    max_batch: int = typer.Option(8, min=1, help="vllm: requests in flight per engine (more "
                                  "wait in the harness, counted in TTFT)"),
    side_by_side: bool = typer.Option(False, help="vllm: run the configurations at the same "
                                      "time (background load hits each alike)"),
    pool: str = typer.Option("auto", help="vllm: files (each lends a segment from a "
                             "/dev/shm file the others copy from: the README's setup) | "
                             "service (the engines join one pool service, shared memory) | "
                             "embedded (each lends a segment, TCP) | auto (files on one host "
                             "when /dev/shm has room, else service; embedded with --hosts)"),
    multiproc: bool = typer.Option(False, "--multiproc", help="vllm: vLLM's multi-process "
                                   "engine, as behind `vllm serve` (scheduler and worker "
                                   "apart; slower on few cores)"),
    dtype: str = typer.Option("bfloat16", help="engines: KV dtype (bfloat16 | float32)"),
    eviction: str = typer.Option("lru", help="engines: kvtier eviction policy (kvtier's default)"),
    admission: str = typer.Option("reuse", help="engines: kvtier admission (reuse | always)"),
    out: Path = typer.Option(Path("replay-out"), help="engines: report, plots, logs"),
    calibration: Optional[Path] = typer.Option(None, help="sim: model calibration file"),
    calibrate: bool = typer.Option(False, "--calibrate", help="measure the real engine for "
                                   "the sim's model (writes --json or OUT/calibration.json)"),
    plots: bool = typer.Option(True, help="engines: write PNG plots"),
    ha: bool = typer.Option(False, "--ha", help="soak with --hosts: Mooncake's HA masters (a "
                            "leader and a standby, etcd on a third host); fault leader-kill"),
    hosts: int = typer.Option(1, min=1, help="engines: spread the instances round-robin over "
                              "this many hosts (network namespaces on this machine, a master "
                              "on one more; needs root)"),
    shared_fs: str = typer.Option("dir", help="with --hosts: the shared filesystem, one "
                                  "directory of this machine (dir) or a GlusterFS volume "
                                  "with a brick and a mount on every host (glusterfs)"),
    soak: Optional[float] = typer.Option(None, min=0.0, help="sim: soak for this many "
                                         "minutes of wall time under faults (kvtier only)"),
    fault_every: float = typer.Option(60.0, min=0.1, help="soak: seconds between faults"),
    faults: str = typer.Option("process-kill,master-restart,disk-full,corrupt-file",
                               help="soak: the faults, injected in this rotation (with "
                               "--hosts also link-cut and host-kill)"),
) -> None:
    """Replay traces against eviction policies (`--simulate`) or engines (`--engine`)."""
    from kvtier.tools.commands import replay_engine as ce
    if calibrate:
        ce.calibrate_and_save(dtype, json_out or out / "calibration.json")
        return
    if engine is not None and simulate:
        raise ReplayError("--engine and --simulate are two modes; give one")
    if population != 1 and engine is not None:
        raise ReplayError("--population is a --simulate option (it grows the generated "
                          "workloads); drop it with --engine")
    if population != 1 and not set(workload) & set(GENERATED):
        raise ReplayError(f"--population applies to the generated workloads "
                          f"({', '.join(GENERATED)}); add -w forks (or chat, rag) or drop it")
    if soak is not None:
        _soak(engine, soak, fault_every, faults, json_out, ha, lambda: ce.EngineSpec(
            engine="sim", workload=_traced((_one_workload(workload),), traces)[0],
            instances=tuple(int(x) for x in _floats(instances, "--instances")),
            router=router, sessions=sessions or 8, live=live, turns=turns, scale=scale,
            speed=speed, dram=_floats(dram, "--dram"), baselines=(), kv_ratio=kv_ratio,
            kv_tokens=kv_tokens, max_output=max_output, max_context=max_context, dtype=dtype,
            eviction=eviction, admission=admission, seed=seed, traces=traces, out=out,
            calibration=calibration, hosts=hosts, shared_fs=shared_fs))
    if engine is not None:
        spec = ce.EngineSpec(
            engine=engine, workload=_one_workload(workload),
            instances=tuple(int(x) for x in _floats(instances, "--instances")),
            router=router, sessions=sessions or 8, live=live, turns=turns, scale=scale,
            speed=speed, dram=_floats(dram, "--dram"),
            baselines=tuple(b for b in baselines.split(",") if b.strip()),
            kv_ratio=kv_ratio, kv_tokens=kv_tokens, max_output=max_output,
            max_context=max_context, max_batch=max_batch, side_by_side=side_by_side,
            pool=pool, multiproc=multiproc, dtype=dtype, eviction=eviction,
            admission=admission, seed=seed, traces=traces, out=out,
            calibration=calibration, hosts=hosts, shared_fs=shared_fs)
        _traced((spec.workload,), traces)  # after the arguments' own checks
        ce.run_and_show(spec, json_out, plots)
        return
    if not simulate:
        raise ReplayError("choose a mode: --simulate (policy-only), --engine vllm|sim, or "
                          "--calibrate")
    sessions = sessions or 64
    spec = RunSpec(
        workloads=_workloads(workload), policies=_policies(policies),
        capacities=_floats(capacities, "--capacities"),
        tiered=None if tiered == "none" else _floats(tiered, "--tiered", 3),
        traces=traces, synthetic=SyntheticSpec(sessions=sessions, live=live or sessions,
                                               seed=seed, prefill_tokens_per_s=prefill_tps),
        weka_live=weka_live, seed=seed, jobs=jobs, online_bound=online_bound,
        gap_oracle=_floats(gap_oracle, "--gap-oracle", zero_ok=True) if gap_oracle else (),
        gap_classes=_gap_classes(gap_classes), gap_info=gap_info, time_scale=time_scale,
        population=population,
        sim=SimParams(bytes_per_token=bytes_per_token, prefill_tokens_per_s=prefill_tps))
    _traced(spec.workloads, traces)  # after the arguments' own checks
    console = Console(width=max(Console().width, 130))  # tables stay readable in logs
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task("loading traces", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, description="replaying", completed=done, total=total)

        report = run(spec, progress)
    render(report, console)
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2, default=str))
        console.print(f"wrote {json_out}")


def _soak(engine: Optional[str], minutes: float, every_s: float, faults: str, json_out,
          ha: bool, spec) -> None:
    """`--soak`: the sim replay under faults (`tools.commands.replay_soak`); exits with its code."""
    from kvtier.tools.commands.replay_soak import run_and_show_soak
    from kvtier.tools.replay.soak.run import SoakSpec
    if engine != "sim":
        raise ReplayError("--soak runs the simulated engines: add --engine sim")
    kinds = tuple(f.strip() for f in faults.split(",") if f.strip())
    raise typer.Exit(run_and_show_soak(SoakSpec(spec(), minutes * 60, every_s, kinds, ha),
                                       json_out))


def _mark(ok) -> str:
    return "" if ok is None else ("[green]yes[/]" if ok else "[red]no[/]")


def _told(sigma) -> str:
    return "nothing" if sigma is None else f"told ±{sigma:.2f}"


def _gap_info_text(name: str, g: dict) -> str:
    """`--gap-info`, one paragraph: the spread of log gaps, then what the class and every
    feature leave of it, on held-out sessions, as the oracle sigma each knowledge equals."""
    return (f"{name} gaps: {g['gaps']:,} ({g['held_out']:,} held out), log spread "
            f"{g['spread']:.2f}; the class ({g['classes']}) leaves {g['class_residual']:.2f} "
            f"({_told(g['told_sigma_class'])}), with {', '.join(g['features'])} "
            f"{g['residual']:.2f} ({_told(g['told_sigma'])}): "
            f"{100 * g['explained_within_class']:.1f}% of what the class leaves")


def render(report: dict, console: Console) -> None:
    """One table per workload, then the tiered table."""
    for name, w in report["workloads"].items():
        pols = [p for p in report["spec"]["policies"]]
        t = Table(title=f"{name}: {w['name']}, {w['requests']:,} requests, footprint "
                  f"{w['footprint_tokens']:,} tokens; token hit rate %, infinite cache "
                  f"{w['infinite']:.1f}")
        bound = any(BOUND in row for row in w["rows"])
        oracles = sorted({k for row in w["rows"] for k in row if k.startswith(ORACLE)},
                         key=lambda k: float(k[len(ORACLE):]))
        for col in ["capacity", *pols, *oracles, "belady", *(["online ≤"] if bound else []),
                    "gap", "closed", "(a)", "(b)"]:
            t.add_column(col, justify="right")
        for row in w["rows"]:
            best = row.get("best_classic")
            cells = [f"{100 * row['capacity']:g}%"]
            for p in pols:
                v = row.get(p)
                bold = p in CLASSIC and best is not None and v == best
                cells.append(f"[bold]{v:.1f}[/]" if bold else f"{v:.1f}")
            closed = row.get("closed")
            cells += [f"{row[k]:.1f}" if k in row else "" for k in oracles]
            cells.append(f"{row['belady']:.1f}")
            if bound:
                cells.append(f"{row[BOUND]:.1f}" if BOUND in row else "")
            cells += [f"{row.get('gap', 0):.1f}",
                      "" if closed is None else f"{100 * closed:.0f}%",
                      _mark(row.get("target_a")), _mark(row.get("target_b"))]
            t.add_row(*cells)
        console.print(t)
        if w.get("gap_info"):
            console.print(_gap_info_text(name, w["gap_info"]))
    spec = report["spec"]
    if not spec.get("tiered"):
        return
    d, n, s = spec["tiered"]
    t = Table(title=f"tiered: dram {100 * d:g}% + nvme {100 * n:g}% + sharedfs {100 * s:g}% "
              f"of the footprint")
    for col in ("workload", "policy", "tiered hit %", "infinite %", "within 1 pt",
                "hits from dram %"):
        t.add_column(col, justify="right")
    for name, w in report["workloads"].items():
        for pol, r in w["tiered"].items():
            t.add_row(name, pol, f"{r['hit']:.1f}", f"{w['infinite']:.1f}",
                      _mark(r["within_1pt"]), f"{r['dram_share']:.1f}")
    console.print(t)
    console.print(f"{report['date']}, {report['machine']}, {report['wall_s']:.0f} s")
