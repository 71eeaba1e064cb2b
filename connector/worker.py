"""Worker side: the paged KV cache of one TP/PP rank, moved to and from the store.

Per step (vLLM's model runner drives it): `start_load_kv` hands the step's asynchronous load
jobs to the load thread (those requests are not running) and runs the synchronous ones
before it returns (their requests run in this step's forward); the forward runs; `wait_for_save`
gathers the step's save jobs into staging buffers right away, so the bytes are out of the
paged blocks before any later step can reuse them (on CUDA the gather and one bulk
device-to-host copy are queued on the compute stream, which orders them before later
writes), then hands sealing and writing to the save thread; `get_finished` reports finished
loads, and held requests once no gather still reads their blocks; failed load blocks go out
through `get_block_ids_with_load_errors` in the same step as their request.

Several KV cache groups (vLLM's hybrid allocator): each group has its own paged view of its
layers (groups may share the memory of one KV tensor: their block ids never overlap), its
own staging and I/O threads and its own namespace; a job names its group. A recurrent
group's frame is one state: a page of state bytes per layer, from the request's block. A
request's load is done when every group's job for it is, and counts as loaded only if all
of them loaded everything (vLLM then takes failures per request: `failed_recving`, never
block ids).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import torch

from kvtier.connector import storeref
from kvtier.connector.config import ConnectorConfig
from kvtier.connector.io_thread import IOThread, LoadBatch, SaveBatch, stage_save
from kvtier.connector.layout import PagedKV
from kvtier.connector.metadata import (KVTierMetadata, KVTierWorkerMeta, LoadJob, SaveJob,
                                       StoreEvent)
from kvtier.connector.naming import (KVShape, architecture, check_layout, kv_groups,
                                     make_namespace, primary, rank_keys, saves_on_rank)
from kvtier.connector.staging import FrameBuffer, StagingPool
from kvtier.connector.stats import KVTierStats
from kvtier.store.base import block
from kvtier.store.base.errors import KVTierError

log = logging.getLogger(__name__)
# How long a step with nothing to compute may wait for a load to finish. Short, so requests
# arriving meanwhile are not held up; long enough to stop spinning through empty steps.
IDLE_WAIT_S = 0.02
# The most a step waits for a staging buffer to save into (all in flight): a healthy tier
# frees one in well under this (a 64 MiB buffer at 100 MB/s, a slow network mount, in 0.64
# s); saves that free none by then are stuck behind a tier that hangs.
SAVE_WAIT_S = 1.0
# How long a step's end waits for the load thread to report the loads it cut (`collect`);
# one it did not report by then is reported at the next step's end.
COLLECT_WAIT_S = 0.005
LENDER_POLL_S = 1.0  # how often the stats vLLM takes every step read lender failures


@functools.cache
def _transfer_results() -> type:
    """vLLM's `KVConnectorTransferResults` (imported once: vLLM asks for results every step)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    return KVConnectorTransferResults


def _ranks() -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker; (0, 0) outside a distributed setup."""
    from vllm.distributed import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        return 0, 0
    return ps.get_tp_group().rank_in_group, ps.get_pp_group().rank_in_group


class _Group:
    """One KV cache group as this worker moves it: its layers' paged view, staging, I/O
    thread and namespace."""

    def __init__(self, shape: KVShape, vllm_config: Any, cfg: ConnectorConfig, tp_rank: int,
                 pp_rank: int):
        self.shape = shape
        self.saves = saves_on_rank(shape, tp_rank)  # replicated KV: rank 0 writes it
        self.fingerprint = make_namespace(vllm_config, shape, cfg.policy, tp_rank,
                                          pp_rank).fingerprint()
        self.paged: PagedKV | None = None
        self.io: IOThread | None = None
        self.save_pool: StagingPool | None = None
        self.saves_stuck = False  # no staging buffer freed within SAVE_WAIT_S (`_gather`)
        self.m = 0  # vLLM blocks per frame


class WorkerSide:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig):
        self.cfg = cfg
        shapes = kv_groups(kv_cache_config, architecture(vllm_config))
        self.shape = primary(shapes)
        tp_rank, pp_rank = _ranks()
        self.rank = pp_rank * vllm_config.parallel_config.tensor_parallel_size + tp_rank
        self.groups = {g.group: _Group(g, vllm_config, cfg, tp_rank, pp_rank) for g in shapes}
        self.main = self.groups[self.shape.group]
        self.fingerprint = self.main.fingerprint
        self.m = cfg.policy.chunk_tokens // self.shape.block_size
        self.num_blocks = kv_cache_config.num_blocks
        self.store = storeref.acquire(cfg.policy, cfg.node_id, mover=True)
        self._unlisten = storeref.on_step_end(cfg.policy, cfg.node_id, self.step_ended)
        self.paged: PagedKV | None = None
        self.io: IOThread | None = None
        self._cuda = False  # the KV cache is on a CUDA device (forwards timed by events)
        self._lenders_due = 0.0  # when `get_stats` next reads the lenders' failures
        # several groups: request -> {group: [chunks asked, chunks loaded or None while
        # out]} of its load jobs, until the last one ends
        self._group_loads: dict[str, dict[int, list]] = {}
        self._failed_reqs: set[str] = set()
        self.stats = KVTierStats()
        self.stats_lock = threading.Lock()
        self._held: set[str] = set()          # finished requests whose blocks we keep
        self._finished_seen: set[str] = set()
        self._gathers: dict[str, list[Any]] = {}  # held req -> CUDA events of its gathers
        self._errors: set[int] = set()
        self._settled: list[tuple[str, int]] = []  # (request, chunks its load job loaded)
        self._forward: tuple | None = None   # (work, start) of the step being computed
        self._timed: list[tuple] = []        # (work, start, end) of forwards to report
        self._idle_step = False
        self._warming: threading.Thread | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        alloc = self._shared_alloc()
        for g in self.groups.values():
            layers = kv_caches if len(self.groups) == 1 else \
                {n: kv_caches[n] for n in g.shape.layer_names if n in kv_caches}
            g.paged = PagedKV(layers, self.num_blocks, g.shape.block_size)
            check_layout(g.paged.info, g.shape)
            # a chunk's frame holds its blocks; a recurrent group's holds one state
            g.m = 1 if g.shape.stateful else self.m
            payload_len = g.m * g.paged.info.block_bytes
            stride = block.frame_size(payload_len, block.PAGE)
            per_buffer = max(1, self.cfg.staging_buffer_bytes // stride)
            device = g.paged.device
            g.save_pool = StagingPool(per_buffer, stride, device, self.cfg.staging_buffers,
                                      self._register, alloc)
            load_pool = StagingPool(per_buffer, stride, device, 1, self._register, alloc)
            # On a CPU cache the prefill runs on the cores a save's work (sealing, the pool's
            # put, its master's share) would take: a request's saves wait for the end of its
            # prefill (BENCHMARKS.md, "Saves that wait for their prompt's prefill").
            hold = self.cfg.policy.mover.yield_to_prefill_s if device.type == "cpu" else 0.0
            g.io = IOThread(self.store, g.paged, load_pool, g.save_pool, g.m,
                            payload_len, self.stats, self.stats_lock, hold,
                            self.cfg.policy.mover.idle_after_s)
            log.info("kvtier: %sKV layout %s%s, %d layers, %d-byte chunks, namespace %s",
                     f"{g.shape.kind} group {g.shape.group}: " if len(self.groups) > 1 else "",
                     g.paged.info.kind, " (fused)" if g.paged.info.fused else "",
                     g.paged.info.num_layers, payload_len, g.fingerprint)
        self.paged, self.io = self.main.paged, self.main.io
        self._cuda = self.paged.device.type == "cuda"
        self._warming = threading.Thread(target=self._warm_staging, name="kvtier-staging-warm",
                                         daemon=True)
        self._warming.start()

    def _warm_staging(self) -> None:
        """Each group's first load and save buffers, made, mapped in and registered while
        the engine starts: made on first use, their page faults (40-50 ms for 64 MiB here)
        and registration fell on the first hits and the first prefills' saves."""
        t0 = time.monotonic()
        made = 0
        try:
            for g in self.groups.values():
                made += g.io.load_pool.warm(1) + g.save_pool.warm(1)
        except Exception as e:  # they are made on first use instead, as without this
            log.warning("kvtier: staging buffers not made ahead (made on first use): %s", e)
            return
        log.debug("kvtier: %d staging buffers made ahead in %.0f ms", made,
                  (time.monotonic() - t0) * 1e3)

    def _shared_alloc(self):
        """The first tier's allocator of memory it moves frames through without a copy (a
        Mooncake pool service can only reach memory shared with it), or None."""
        for tier in getattr(self.store, "tiers", ()):
            alloc = getattr(tier, "alloc_shared", None)
            if alloc is None:
                continue

            def shared_or_private(nbytes: int, alloc=alloc, name=tier.name) -> memoryview:
                try:
                    return alloc(nbytes)
                except KVTierError as e:  # still works, through the tier's own staging copy
                    log.warning("kvtier: staging buffer not shared with tier %s: %s", name, e)
                    return block.alloc_aligned(nbytes)
            return shared_or_private
        return None

    def _register(self, buf: FrameBuffer) -> None:
        """Let tiers that can (Mooncake) move frames straight to and from this buffer."""
        for tier in getattr(self.store, "tiers", ()):
            register = getattr(tier, "register", None)
            if register is None:
                continue
            try:
                register(buf.memory)
            except KVTierError as e:  # still works, through the tier's own staging copy
                log.warning("kvtier: staging buffer not registered with tier %s: %s",
                            tier.name, e)

    # ---- per step -----------------------------------------------------------------------

    def begin_step(self, meta: KVTierMetadata) -> None:
        """The step's metadata arrived; its forward starts now (timed for the scheduler's
        recompute model; on CUDA with events, as the forward runs asynchronously)."""
        self._forward = None
        self.step_ended()  # the last step's, if nothing told it before
        if meta.prefill and self.store is not None:
            self.store.engine_busy(True)
        if meta.work[0] <= 0 or any(job.sync for job in meta.loads):
            return  # nothing to time, or a synchronous load inside the interval
        self._forward = (meta.work, self._now())

    def _now(self):
        if not self._cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start_load_kv(self, meta: KVTierMetadata, idle_step: bool = False) -> None:
        """Queue the step's loads; `idle_step`: the step has nothing to compute."""
        self._idle_step = idle_step
        if meta.events:
            self._observe(meta.events)
        self._held.update(meta.hold)
        if meta.loads:
            self._require_registered()
            # the load thread starts on the asynchronous ones while the others run here
            for job in sorted(meta.loads, key=lambda j: j.sync):
                io = self.groups[job.group].io
                if len(self.groups) > 1:
                    self._group_loads.setdefault(job.req_id, {})[job.group] = [len(job.keys),
                                                                                None]
                if job.sync:
                    io.load_now(self._load_batches(job))
                else:
                    io.submit_load(self._load_batches(job))
                    log.debug("kvtier: load %s queued: %d chunks", job.req_id, len(job.keys))

    def _observe(self, events: list[StoreEvent]) -> None:
        """Replay the scheduler's lookups and turn ends into this process's store, before
        this step's loads (so their pins are in place before the loads release them)."""
        try:
            for ev in events:
                keys = rank_keys(ev.keys, self.fingerprint)
                if ev.kind == "lookup":
                    self.store.observe_lookup(keys, ev.hits, ev.hint, ev.held)
                else:
                    self.store.finish(keys, ev.hint)
        except KVTierError as e:  # bookkeeping: the step and its requests go on without it
            log.warning("kvtier: session bookkeeping failed: %s", e)

    def _load_batches(self, job: LoadJob) -> list[LoadBatch]:
        group = self.groups[job.group]
        keys = rank_keys(job.keys, group.fingerprint)
        step = group.io.load_pool.capacity
        starts = list(range(0, len(keys), step))
        # The request waits from now: past its deadline, what has not arrived is recomputed.
        deadline = None if job.deadline_s is None else time.monotonic() + job.deadline_s
        # Each batch's share of the grace, by its share of the chunks.
        grace = job.grace_s / max(1, len(keys))
        return [LoadBatch(job.req_id, keys[s:s + step], job.block_ids[s:s + step],
                          job.skip_first if s == 0 else 0, last=(s == starts[-1]),
                          tiers=job.tiers[s:s + step] or None, sync=job.sync,
                          deadline=deadline, grace_s=grace * len(keys[s:s + step]),
                          span_s=job.deadline_s or 0.0)
                for s in starts]

    def wait_for_save(self, meta: KVTierMetadata) -> None:
        if self._forward is not None:  # the forward is done (on CUDA: queued) by now
            self._timed.append((*self._forward, self._now()))
            self._forward = None
        if meta.saves:
            self._require_registered()
            for job in meta.saves:
                if self.groups[job.group].saves:
                    self._gather(job)
        # After the gathers: what this releases (saves, persists) would compete with them.
        if self.store is not None:
            if meta.work[0] > 0:
                self.store.engine_stepped()  # a decode too: persists wait for an idle engine
            if not meta.prefill_continues:
                self.store.engine_busy(False)  # the prefill (if any) is done
            for g in self.groups.values():
                if g.io is not None:
                    g.io.prefilling(meta.prefilling)

    def step_ended(self) -> None:
        """The step is over: its outputs are out (told by the scheduler side when it shares
        this process) or the next step began. The saves it gathered may go (but for a
        prefill that goes on)."""
        for g in self.groups.values():
            if g.io is not None:
                g.io.step_ended()

    def _gather(self, job: SaveJob) -> None:
        group = self.groups[job.group]
        keys = rank_keys(job.keys, group.fingerprint)
        step = group.save_pool.capacity
        for s in range(0, len(keys), step):
            # Backpressure while every buffer is in flight, bounded: saves that free none in
            # SAVE_WAIT_S are stuck (a put to a pool master that froze waits for Mooncake's
            # RPC timeout, 30 s), and the engine's step must not wait with them. Until one
            # frees, the saves of later steps are dropped at once instead.
            buf = group.save_pool.acquire(0.0 if group.saves_stuck else SAVE_WAIT_S)
            if buf is None:
                self._drop_saves(group, job, len(keys) - s)
                return
            group.saves_stuck = False
            ready = stage_save(group.paged, buf, job.block_ids[s:s + step], group.m)
            if ready is not None and job.req_id in self._held:  # its blocks wait for this
                self._gathers.setdefault(job.req_id, []).append(ready)
            group.io.submit_save(SaveBatch(job.req_id, keys[s:s + step], buf, job.hint,
                                           ready))

    def _drop_saves(self, group: _Group, job: SaveJob, chunks: int) -> None:
        if not group.saves_stuck:
            log.warning("kvtier: saves are stuck (no staging buffer freed in %.1f s: a tier "
                        "that hangs?); dropping new saves until one frees, from request %s's",
                        SAVE_WAIT_S, job.req_id)
        group.saves_stuck = True
        with self.stats_lock:
            self.stats.add("save_dropped_chunks", chunks)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finished_seen |= finished_req_ids
        sending = set()
        for req_id in list(self._held & self._finished_seen):
            events = self._gathers.get(req_id, [])
            if all(e.query() for e in events):
                sending.add(req_id)
                self._held.discard(req_id)
                self._finished_seen.discard(req_id)
                self._gathers.pop(req_id, None)
        self._finished_seen -= self._finished_seen - self._held  # only held ones matter
        recving: set[str] = set()
        if self.io is not None:
            if self._idle_step:  # nothing else to do this step: wait for a load, briefly
                until = time.monotonic() + IDLE_WAIT_S
                for g in self.groups.values():  # a request is done when all its groups are
                    g.io.wait_for_load(max(0.0, until - time.monotonic()))
            for g in self.groups.values():  # loads past their deadline are cut now
                g.io.collect(COLLECT_WAIT_S)
            if len(self.groups) == 1:
                done, failed, settled = self.io.take_results()
                self._errors |= failed
                self._settled.extend(settled)
            else:
                done, failed = self._group_results(), self._failed_reqs
            recving.update(done)
            if done:
                log.debug("kvtier: loads done %s, %d failed", sorted(done), len(failed))
        return sending or None, recving or None

    def _group_results(self) -> list[str]:
        """Several groups: the requests whose every group's load ended. Each is settled
        with the primary group's chunks if every group loaded all it was asked for, else
        with 0, and then goes to `failed_recving`."""
        for gid, group in self.groups.items():
            _, _, settled = group.io.take_results()
            for req, n in settled:
                job = self._group_loads.get(req, {}).get(gid)
                if job is not None:
                    job[1] = n
        done = []
        for req, jobs in list(self._group_loads.items()):
            if any(n is None for _, n in jobs.values()):
                continue
            del self._group_loads[req]
            whole = all(n >= asked for asked, n in jobs.values())
            main = jobs.get(self.shape.group, [0, 0])[1]
            self._settled.append((req, main if whole else 0))
            if not whole:
                self._failed_reqs.add(req)
            done.append(req)
        return done

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's `KVConnectorTransferResults`: `get_finished`, and the requests whose load
        fell short (several groups: recomputed whole, as vLLM takes such failures)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_reqs = self._failed_reqs, set()
        return _transfer_results()(set(sending or ()), set(recving or ()) | failed, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def build_worker_meta(self) -> KVTierWorkerMeta | None:
        """What this step's finished load jobs loaded (the scheduler's hit accounting) and
        the forwards timed since the last step (its recompute model)."""
        steps, left = [], []
        for work, start, end in self._timed:
            if isinstance(end, float):
                steps.append((*work, end - start))
            elif end.query():  # a CUDA event pair whose forward has finished
                steps.append((*work, start.elapsed_time(end) / 1e3))
            else:
                left.append((work, start, end))
        self._timed = left[-64:]
        if not (self._settled or steps):
            return None
        meta = KVTierWorkerMeta([(req, self.rank, n) for req, n in self._settled], steps)
        self._settled = []
        return meta

    def get_stats(self) -> KVTierStats | None:
        # vLLM asks every step; lender failures are rare and read across every tier, so
        # they are collected every `LENDER_POLL_S` (the index's counters have them at once).
        gained = {}
        now = time.monotonic()
        if now >= self._lenders_due:
            self._lenders_due = now + LENDER_POLL_S
            gained = self.store.take_lender_failures()
        with self.stats_lock:
            for lender, n in gained.items():
                self.stats.add(f"lender_failures:{lender}", n)
            return self.stats.take()

    def shutdown(self) -> None:
        """Write what is queued (saves, then the mover's persists) before the process ends:
        vLLM calls this when it stops its workers gracefully (`--shutdown-timeout` > 0)."""
        t0 = time.monotonic()
        if self._warming is not None:  # it registers buffers with the store closed below
            self._warming.join()
            self._warming = None
        self._unlisten()
        if self.io is not None:
            # Said before the work: vLLM kills a worker whose stop takes longer than it
            # allows (README, Operations), and the log should show what was at stake.
            log.info("kvtier: worker stopping: writing %d queued save batches, then the "
                     "mover's %d queued blocks",
                     sum(g.io.pending_saves() for g in self.groups.values() if g.io),
                     self.store.mover_pending() if self.store is not None else 0)
            for g in self.groups.values():
                if g.io is not None:
                    g.io.stop()
                    g.io = None
            self.io = None
        if self.store is not None:
            pending = self.store.mover_pending()
            if storeref.release(self.store):  # the last user: the mover drained on close
                dropped = self.store.mover_stats().get("promote_dropped_at_stop", 0)
                log.info("kvtier: worker stopped in %.1f s: queued saves written, the mover's "
                         "%d queued blocks moved down (%d promotions dropped)",
                         time.monotonic() - t0, pending - dropped, dropped)
            self.store = None

    def _require_registered(self) -> None:
        if self.io is None:
            raise RuntimeError("kvtier: KV jobs arrived before register_kv_caches; the engine "
                               "must register its KV caches with the connector first")
