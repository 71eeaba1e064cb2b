"""Connector statistics, carried through vLLM's `KVConnectorStats` to its logs and Prometheus.

`data` is plain, picklable: `{"counters": {name: number}, "ms": {"load": [...], "save":
[...]}}`. Counters sum when aggregated across workers and intervals; `ms` lists are the
per-batch durations. Counter names: `hit_tokens:<tier>` (scheduler, tokens loaded from each
tier, counted once the workers say they landed), `recomputed_tokens` (scheduler: promised,
then recomputed), `declined_tokens` (scheduler: found, recomputed because loading them
would have taken longer), `lookups`, `lookup_tokens` (tokens asked for),
`lookups_deferred` (lookups not answered within the scheduler's inline wait: their
request waited a step or more), `lookups_given_up` (lookups still unanswered when waiting
had cost what recomputing the request would: the request was computed), `load_bytes`,
`load_chunks`, `load_in_place_chunks` (of those, scattered straight from a pool segment file),
`load_error_blocks`, `load_late_chunks` (chunks not loaded by their deadline),
`load_late_starts` (load batches that started past the time their deadline left them, and
got their grace from their start),
`lender_failures:<lender>` (pool blocks whose read failed or came late, by the transport
endpoint of the process lending them), `save_bytes`, `save_chunks`, `save_failed_chunks`,
`save_dropped_chunks` (not saved: the saves before them were stuck behind a tier that hangs,
and the engine's step does not wait for them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


def _empty() -> dict[str, Any]:
    return {"counters": {}, "ms": {"load": [], "save": []}}


@dataclass
class KVTierStats(KVConnectorStats):
    def __post_init__(self):
        if "counters" not in self.data:
            self.data = _empty()

    def reset(self) -> None:
        self.data = _empty()

    def add(self, name: str, value: float = 1) -> None:
        counters = self.data["counters"]
        counters[name] = counters.get(name, 0) + value

    def observe_ms(self, kind: str, ms: float) -> None:
        self.data["ms"][kind].append(ms)

    def aggregate(self, other: KVConnectorStats) -> "KVTierStats":
        if other.is_empty():
            return self
        for name, value in other.data["counters"].items():
            self.add(name, value)
        for kind, values in other.data["ms"].items():
            self.data["ms"].setdefault(kind, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        for kind, values in self.data["ms"].items():
            if values:
                out[f"{kind}_ms_avg"] = round(sum(values) / len(values), 3)
                out[f"{kind}_ms_max"] = round(max(values), 3)
        return out

    def is_empty(self) -> bool:
        return not self.data["counters"] and not any(self.data["ms"].values())

    def take(self) -> "KVTierStats | None":
        """A snapshot to ship (None when nothing happened), leaving this one empty."""
        if self.is_empty():
            return None
        snap = KVTierStats(data=self.data)
        self.data = _empty()
        return snap


class KVTierPromMetrics(KVConnectorPromMetrics):
    """`kvtier_*` counters and histograms, labelled per engine (and per tier for hits)."""

    _COUNTERS = {
        "lookup_tokens": "Prompt tokens kvtier was asked about",
        "lookups_deferred": "Lookups that took longer than the scheduler's inline wait: "
                            "their request waited a step or more",
        "lookups_given_up": "Lookups given up unanswered (a tier that hangs): the request "
                            "was computed",
        "load_bytes": "Bytes loaded from kvtier into the paged KV cache",
        "load_in_place_chunks": "Chunks loaded straight from a pool segment file, no copy",
        "save_bytes": "Bytes saved from the paged KV cache into kvtier",
        "load_error_blocks": "vLLM blocks kvtier failed to load (recomputed)",
        "recomputed_tokens": "Prompt tokens kvtier promised and vLLM then recomputed",
        "declined_tokens": "Prompt tokens found in kvtier and recomputed because loading "
                           "them would have taken longer",
        "load_late_chunks": "Chunks not loaded by their load's deadline (recomputed)",
        "load_late_starts": "Load batches that started late, behind other loads, and got "
                            "their grace from their start",
        "save_failed_chunks": "Chunks kvtier could not save",
        "save_dropped_chunks": "Chunks not saved because the saves before them were stuck "
                               "(a tier that hangs); the engine did not wait",
    }

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"kvtier_{name}_total", documentation=doc,
                                    labelnames=labelnames)
            for name, doc in self._COUNTERS.items()}
        self._hits = self._counter_cls(name="kvtier_hit_tokens_total",
                                       documentation="Prompt tokens served by kvtier, by tier",
                                       labelnames=labelnames + ["tier"])
        self._lenders = self._counter_cls(
            name="kvtier_lender_failures_total", labelnames=labelnames + ["lender"],
            documentation="Pool blocks whose read failed or came late, by the lender holding them")
        buckets = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
        self._seconds = {
            kind: self._histogram_cls(name=f"kvtier_{kind}_seconds", buckets=buckets,
                                      documentation=f"Duration of one kvtier {kind} batch",
                                      labelnames=labelnames)
            for kind in ("load", "save")}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name.startswith("hit_tokens:"):
                self._hits.labels(*labels, name.split(":", 1)[1]).inc(value)
            elif name.startswith("lender_failures:"):
                self._lenders.labels(*labels, name.split(":", 1)[1]).inc(value)
            elif name in self._counters:
                self._counters[name].labels(*labels).inc(value)
        for kind, values in transfer_stats_data.get("ms", {}).items():
            if kind in self._seconds:
                hist = self._seconds[kind].labels(*labels)
                for ms in values:
                    hist.observe(ms / 1000.0)
