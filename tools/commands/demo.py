"""`kvtier demo` (what `make demo` runs): the main job, scaled to a few minutes on a laptop.

Real vLLM engines (the tiny random model, one process each) replay the synthetic agentic
workload, round-robin routed, twice: on one kvtier cluster (embedded master, the DRAM pool,
an nvme dir per instance, one shared dir) and with vLLM's own prefix cache only (each
instance's KV cache holds a quarter or less of the contexts live on it). It prints the
comparison (hit rates, TTFT, throughput, bytes per tier, per turn) and where the JSON
report and the plots are. Every knob of the full run is `kvtier replay --engine vllm`.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.tools.commands.replay_engine import console, run_and_show
from kvtier.tools.replay.experiment import EngineSpec

# The demo is the main job scaled down (fewer, shorter sessions; think time kept), so the
# issue's targets (the report's last table) are for the full run.
FULL_RUN = ("kvtier replay --engine vllm -w synthetic --instances 4 --sessions 14 "
            "--dtype float32 --dram 1.5,0.25 --speed 1000")


# Two pool sizes, so the hit-rate-against-DRAM plot is a curve: one that holds the working
# set, and one smaller, where the disk tiers serve the rest. The smaller one is as small as
# Mooncake allows at this size: each of the instances lends at least a 16 MiB segment, and
# float32 KV at scale 0.15 makes the working set (~80 MiB) large enough for 4 x 16 MiB to
# be 80% of it.
DEMO_DRAM = (1.5, 0.8)


def demo_spec(instances: int = 4, sessions: int = 8, turns: int = 8, scale: float = 0.15,
              speed: float = 4.0, out: Path = Path("replay-out/demo"),
              baselines: tuple[str, ...] = ("local",), engine: str = "vllm") -> EngineSpec:
    return EngineSpec(engine=engine, workload="synthetic", instances=(instances,),
                      router="round-robin", sessions=sessions, turns=turns, scale=scale,
                      speed=speed, dram=DEMO_DRAM, dtype="float32", baselines=baselines,
                      out=out)


def run_demo(**kw) -> dict:
    report = run_and_show(demo_spec(**kw))
    console().print(f"[dim]The targets above are the full main job's, and their notes say what "
                    f"bounds them at this scale: few short sessions (the first sight of each "
                    f"prompt is a large share of the tokens) and short prompts (a hit saves at "
                    f"most the prefill it replaces). The full run (BENCHMARKS.md): {FULL_RUN}[/]")
    return report
