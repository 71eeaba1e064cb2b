"""`KVTierConnector`: vLLM's `KVConnectorBase_V1`, a thin facade over two sides.

vLLM builds one instance per role: in the scheduler (`SchedulerSide`: lookups, load and save
planning) and in each worker (`WorkerSide`: the paged cache, staging, the I/O thread). Each
method forwards to the side that owns it; calling a method of the other role is a bug in the
caller and fails loudly. Config comes from `kv_connector_extra_config` (see
`kvtier.connector.config`); works alone and as a `MultiConnector` child.

kvtier is a best-effort cache: a block that cannot be loaded is recomputed, never an error
for the request, so the scheduler side switches vLLM's `kv_load_failure_policy` to
`recompute` (for a `MultiConnector`, set it at the top level of `--kv-transfer-config`).

It implements `SupportsHMA`, so vLLM keeps its hybrid memory allocator on: models with
sliding-window layers beside full attention run with one KV cache group per kind, and a
sliding-window group's blocks outside the window are freed as vLLM frees them without a
connector (see `kvtier.connector.scheduler` for what is stored per group).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connector.config import parse_extra_config
from kvtier.connector.metadata import KVTierMetadata, KVTierWorkerMeta
from kvtier.connector.stats import KVTierPromMetrics, KVTierStats

log = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """Send kvtier's log records through vLLM's handlers (same format, same destination)."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if not ours.handlers:
        ours.handlers = list(theirs.handlers)
        ours.setLevel(theirs.level or logging.INFO)  # VLLM_LOGGING_LEVEL applies to both
        ours.propagate = not ours.handlers


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        cfg = parse_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvtier.connector.scheduler import SchedulerSide
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, cfg)
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.info("kvtier: setting kv_load_failure_policy=recompute (a block kvtier "
                         "cannot load is recomputed, never a failed request)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
        else:
            from kvtier.connector.worker import WorkerSide
            self._worker = WorkerSide(vllm_config, kv_cache_config, cfg)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, not a lost hand-off

    @property
    def scheduler(self):
        if self._scheduler is None:
            raise RuntimeError("kvtier: scheduler-side method called on a worker connector")
        return self._scheduler

    @property
    def worker(self):
        if self._worker is None:
            raise RuntimeError("kvtier: worker-side method called on a scheduler connector")
        return self._worker

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVTierMetadata):
            self._worker.begin_step(connector_metadata)  # before the step's forward

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        idle = getattr(forward_context, "attn_metadata", None) is None  # a step without forward
        self.worker.start_load_kv(self._meta(), idle)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a load moves whole chunks (all layers); a synchronous one is done already

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole chunks are gathered across all layers in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return self.worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        return self.worker.build_worker_meta()

    def _meta(self) -> KVTierMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierMetadata):
            raise TypeError(f"kvtier: expected KVTierMetadata, got {type(meta).__name__}")
        return meta

    # ---- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        return self.scheduler.hit_sources(request, num_external_tokens)

    # ---- both ---------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        return side.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVTierStats(data=data) if data is not None else KVTierStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self._worker, self._scheduler):
            if side is not None:
                side.shutdown()
