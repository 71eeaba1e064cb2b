"""`kvtier bench vllm`, `kvtier bench serve` and `kvtier bench gather`: the connector's data
paths, measured."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvtier.tools.jsonout import write_report


def vllm(sizes: str = typer.Option("4096,8192,16384", help="prompt sizes in tokens"),
         repeats: int = typer.Option(3, min=1, help="prompts per size and case (median)"),
         chunk_tokens: int = typer.Option(32, help="policy chunk_tokens (32 = vLLM's block "
                                          "size: a remote hit recomputes what a local one "
                                          "does)"),
         dtype: str = typer.Option("bfloat16", help="engine dtype (bfloat16, float32)"),
         multiproc: bool = typer.Option(False, "--multiproc", help="vLLM's multi-process "
                                        "engine (scheduler and worker apart; slow start)"),
         pool: str = typer.Option("files", help="files: each engine lends its segment "
                                  "from a /dev/shm file the other reads directly; service: "
                                  "both engines join one pool service (shared memory); "
                                  "embedded: each lends its own segment, the other reads "
                                  "it over TCP"),
         load: str = typer.Option("async", help="the connector's load setting: async, sync, "
                                  "auto (sync when the engine runs nothing else)"),
         busy: int = typer.Option(0, min=0, help="processes keeping a core busy each "
                                  "beside the engines (a CPU-heavy job on the host)"),
         model_kind: str = typer.Option("llama", "--model-kind", help="the tiny random "
                                        "model: llama, mla (DeepSeek-V2 shape), swa (Gemma 3 "
                                        "shape: sliding window beside full attention), hybrid "
                                        "(Granite 4.0-H shape: Mamba2 beside attention), "
                                        "nemotronh, qwen3next (gated delta-net, bfloat16)"),
         hybrid_allocator: bool = typer.Option(True, "--hybrid-allocator/--no-hybrid-allocator",
                                               help="vLLM's hybrid memory allocator (off: a "
                                               "sliding-window model keeps one KV cache "
                                               "group, every layer for every token)"),
         dir: Optional[Path] = typer.Option(None, "--dir", help="keep the model, tiers and "
                                            "logs here (default: a temp dir)"),
         json_out: Optional[Path] = typer.Option(None, "--json", help="write the numbers here"),
         peers: Optional[str] = typer.Option(None, "--peers", help="instead: kvtier beside "
                                             "other connectors (mooncake-store, lmcache; "
                                             "comma-separated) and vLLM alone, cold / local "
                                             "/ cross-process hit, outputs checked"),
         decode: int = typer.Option(0, "--decode", min=0, help="with --peers: the cold "
                                    "request generates this many tokens and its decode "
                                    "steps are timed (while each system saves what the "
                                    "prefill computed)"),
         ) -> None:
    """TTFT on real vLLM engines: cold, local prefix hit, remote hit from dram/nvme/shared."""
    from kvtier.tools.bench.vllm import BenchSpec, run_bench
    from kvtier.tools.vllm_engine import MODEL_KINDS

    if peers is not None:
        from kvtier.tools.commands.bench_peers import run_peers_command
        run_peers_command(peers, sizes, repeats, dtype, pool, not multiproc, dir, json_out,
                          decode)
        return
    if decode:
        raise typer.BadParameter("the decode steps are timed beside the peers: add --peers "
                                 "(e.g. --peers mooncake-store)", param_hint="--decode")
    if model_kind not in MODEL_KINDS:
        raise typer.BadParameter(f"{model_kind!r}: use one of {', '.join(MODEL_KINDS)}",
                                 param_hint="--model-kind")
    spec = BenchSpec(sizes=tuple(int(s) for s in sizes.split(",")), repeats=repeats,
                     chunk_tokens=chunk_tokens, dtype=dtype, inproc=not multiproc, pool=pool,
                     load=load, busy=busy, model_kind=model_kind,
                     hybrid_allocator=hybrid_allocator)
    console = Console(width=max(110, Console().width))
    with console.status("kvtier bench vllm") as status:
        doc = run_bench(spec, dir, progress=lambda msg: status.update(f"bench vllm: {msg}"))
    for stat in ("median", "min", "p99"):
        beside = f", {busy} busy cores beside" if busy else ""
        render(console, doc, stat, f"kvtier bench vllm: TTFT in ms ({stat} of {repeats}), "
                                   f"tiny {model_kind} {dtype}, chunk {spec.chunk_tokens}, "
                                   f"pool {pool}, load {load}{beside}")
    console.print(f"  stored: {doc['stored_bytes_per_token']} bytes per token")
    console.print(f"  b's first remote hit (maps a's segment; not in the table): "
                  f"{doc['first_remote_hit_ms']} ms, {min(spec.sizes)} tokens")
    for t in doc["targets"]:
        mark = "[green]ok[/]" if t["ok"] else "[red]MISSED[/]"
        console.print(f"  {t['size']:>6} tokens, {t['stat']:>6}: {t['what']}: {t['value']} "
                      f"{mark}")
    for res in doc["results"]:
        for m in res["tier_mismatches"]:
            console.print(f"  [yellow]tier mismatch[/] {m}")
    if json_out is not None:
        write_report(doc, json_out)


def render(console: Console, doc: dict, stat: str, title: str) -> None:
    """The TTFT table of one statistic (median or min)."""
    from kvtier.tools.bench.vllm import CASES
    table = Table(title=title)
    for col in ("tokens", *CASES, "dram/local", "cold/dram"):
        table.add_column(col, justify="right")
    for res in doc["results"]:
        med = res[f"{stat}_ms"]
        cells = [f"{med[c]:.1f}" if med[c] is not None else "-" for c in CASES]
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
        table.add_row(str(res["size"]), *cells, ratio(med["dram"], med["local"]),
                      ratio(med["cold"], med["dram"]))
    console.print(table)


def serve(requests: int = typer.Option(20, min=1, help="prompts, each cold on a, then a "
                                       "hit on b"),
          tokens: int = typer.Option(8192, min=256, help="tokens per prompt"),
          busy: int = typer.Option(2, min=0, help="processes keeping a core busy each "
                                   "beside the servers (a CPU-heavy job on the host)"),
          pool: str = typer.Option("files", help="files: the README's setup, each server "
                                   "lends from a /dev/shm file the other reads in place; "
                                   "embedded: each lends its own segment, the other reads "
                                   "it over TCP"),
          gap_s: float = typer.Option(1.0, "--gap-s", min=0, help="seconds between a's "
                                      "answer and b's request (an agent's turn)"),
          kvtier_path: Optional[Path] = typer.Option(None, "--kvtier-path", help="run the "
                                                     "servers on the kvtier package found "
                                                     "here (a directory holding `kvtier/`: "
                                                     "an older checkout, measured beside "
                                                     "this one)"),
          dir: Optional[Path] = typer.Option(None, "--dir", help="keep the model, tiers and "
                                             "logs here (default: a temp dir)"),
          json_out: Optional[Path] = typer.Option(None, "--json", help="write the numbers "
                                                  "here"),
          ) -> None:
    """TTFT through two OpenAI API servers in the README's setup, beside a CPU-heavy job:
    no hit should take longer than 1.2x the median cold prefill."""
    from kvtier.tools.bench.serve import ServeSpec, run_serve_bench

    if kvtier_path is not None and not (kvtier_path / "kvtier").is_dir():
        raise typer.BadParameter(f"{kvtier_path}: no kvtier/ package in it (give the "
                                 "directory that holds kvtier/)", param_hint="--kvtier-path")
    try:
        spec = ServeSpec(requests=requests, tokens=tokens, busy=busy, pool=pool, gap_s=gap_s,
                         pythonpath=str(kvtier_path.resolve()) if kvtier_path else None)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    console = Console(width=max(110, Console().width))
    with console.status("kvtier bench serve") as status:
        doc = run_serve_bench(spec, dir, progress=lambda m: status.update(f"bench serve: {m}"))
    table = Table(title=f"kvtier bench serve: TTFT in ms through the API, {requests} prompts "
                        f"of {tokens} tokens, pool {pool}, {busy} busy cores beside")
    for col in ("request", "cold (a)", "hit (b)", "loaded", "recomputed", "same token"):
        table.add_column(col, justify="right")
    for i, r in enumerate(doc["requests"], 1):
        loaded = ", ".join(f"{t} {n}" for t, n in r["hit_tokens"].items()) or "-"
        table.add_row(str(i), f"{r['cold_s'] * 1e3:.0f}", f"{r['hit_s'] * 1e3:.0f}", loaded,
                      str(r["recomputed_tokens"] if r["recomputed_tokens"] is not None
                          else "-"), _same_token(r))
    console.print(table)
    s = doc["summary"]
    if s["different_outputs"]:
        console.print(f"  {s['different_outputs']} of {len(doc['requests'])} hits answered "
                      f"another token, {s['different_at_runner_up']} of them a's runner-up "
                      "(margin: how much a preferred its own; bf16 near-ties flip with the "
                      "batch shape, in vLLM's own prefix cache too)")
    mark = "[green]ok[/]" if s["ok"] else "[red]MISSED[/]"
    console.print(f"  cold P50 {s['cold_p50_ms']} P99 {s['cold_p99_ms']}; hit P50 "
                  f"{s['hit_p50_ms']} P99 {s['hit_p99_ms']} ms")
    console.print(f"  worst hit / median cold: {s['worst_hit_over_median_cold']} (target <= "
                  f"{s['target']}) {mark}")
    console.print("  b's metrics: " + ", ".join(f"{k} {v:g}" for k, v in
                                                doc["metrics_b"].items()))
    if json_out is not None:
        write_report(doc, json_out)


def _same_token(row: dict) -> str:
    """`bench serve`'s verdict on a hit's token against the cold one."""
    if row["same_output"]:
        return "yes"
    if row.get("runner_up"):
        return f"[yellow]runner-up, margin {row['cold_margin']:.3f}[/]"
    return "[red]NO[/]"


def gather(ctx: typer.Context) -> None:
    """Paged-KV gather/scatter through staging vs the bulk copy ceiling (CUDA or CPU);
    --help lists its options."""
    from kvtier.tools.bench import gather as bench_gather
    bench_gather.main(ctx.args)  # argparse: its own --help lists every option


# Every argument, --help included, goes to the measurement's own argparse parser.
GATHER_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True,
                   "help_option_names": []}
