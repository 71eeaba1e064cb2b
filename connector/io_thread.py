"""The worker's background I/O threads: every store load and save runs on them.

Loads have a thread of their own (a request waits on them), the one due first first
(`LoadQueue`); saves another. With one thread for both, a load that arrived while a save
was being written waited for that save to end: tens of ms on a host whose cores the
prefills hold, a whole deadline for a load of a few chunks. A load batch reads up to one
staging buffer of chunks from the store (verified there: a corrupt or missing chunk is a
MISS), scatters the chunks before the first miss into the paged cache, and reports the
blocks of the missed chunk and of every later chunk of the request as failed, so vLLM
recomputes from the first of them. On a CPU cache, chunks the
store can hand out where they lie (runs in another engine's pool segment file,
`TieredStore.locate`) are scattered from there, without the copy into staging, and what
landed in the cache is checked. A save batch arrives already gathered into a staging buffer
(by the main thread, in `wait_for_save`); here it is sealed (header + checksum) and written
through the store. A failed save is only a future miss: it is counted and logged, never
retried inline. With a hold (`hold_saves_s`: a CPU cache, where a prefill and a save share
the cores) a request's saves wait while its prompt is still being computed (`prefilling`),
until that prefill ends, the hold passes, or the engine would wait for a save buffer; loads
and other requests' saves pass them. A request saves only what it missed: its own new
tokens, which no other engine wants before the session's next turn, or a prefix seen for
the first time by several requests at once, whose later arrivals now find it after the
first one's whole prefill instead of after its first steps.

Thread safety: `submit_*` are called from the model-runner thread; results are taken with
`take_results`. A synchronous load (`load_now`) runs in the model-runner thread itself,
beside the load thread; the two share the load staging buffers, one at a time. On CUDA,
loads run on a side stream that is synchronised before a request is reported, and a save
waits for the event recorded after its device-to-host copy.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

from kvtier.connector.layout import PagedKV
from kvtier.connector.staging import FrameBuffer, StagingPool
from kvtier.store.base import block
from kvtier.store.base.errors import KVTierError

if TYPE_CHECKING:  # kept out at run time: this module runs where only torch is installed
    from kvtier.connector.stats import KVTierStats
    from kvtier.store.tiered import SessionHint, TieredStore

log = logging.getLogger(__name__)
# A load batch with a deadline is read in runs of about this size, one after another (each
# one batched call of the tiers): the runs in by the deadline count, so a late load keeps
# the part of its hit that arrived.
PART_BYTES = 8 << 20


@dataclass
class LoadBatch:
    req_id: str
    keys: list[str]
    block_ids: list[list[int]]
    skip_first: int        # leading blocks of row 0 not written
    last: bool             # the request's final batch
    tiers: list[str] | None = None  # where the lookup found each chunk (asked first)
    sync: bool = False     # run by `load_now`: its request is not reported as received
    deadline: float | None = None   # `time.monotonic()` past which what has not arrived fails
    grace_s: float = 0.0   # the least time it gets from its start: the deadline moves out to it
    span_s: float = 0.0    # the deadline's length: the most an async load waits past it
    queued: float = field(default_factory=time.monotonic)  # when the worker queued it


@dataclass
class SaveBatch:
    req_id: str
    keys: list[str]
    buf: FrameBuffer
    hint: "SessionHint | None"
    ready: object | None = None  # a CUDA event to wait for before reading `buf.host`
    t0: float = field(default_factory=time.perf_counter)
    step: int = 0  # the engine step that gathered it (`IOThread.submit_save` sets it)


class LoadQueue:
    """Load batches, taken earliest deadline first (ties and no deadline: arrival
    order). Not thread-safe: the I/O threads' lock guards it.

    One thread serves every request's loads. Taken in arrival order, a short load queued
    behind a long one waited out its whole deadline there and was recomputed with its
    data in place (seen on the WEKA replay: a load of 81 chunks behind one of 271).
    Taking the batch whose deadline comes first meets every deadline that any order
    would meet (EDF on one server, here at the grain of a batch), and the long load,
    whose deadline is long because recomputing it is, gives up only the short loads'
    time. Batches of one deadline (a request's own, which must run in order) keep their
    arrival order; batches with no deadline come after every one that has one.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, LoadBatch]] = []
        self._seq = itertools.count()

    def extend(self, batches: Iterable[LoadBatch]) -> None:
        for b in batches:
            due = math.inf if b.deadline is None else b.deadline
            heapq.heappush(self._heap, (due, next(self._seq), b))

    def pop(self) -> LoadBatch:
        """The batch due first; IndexError when empty."""
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)


def stage_save(paged: PagedKV, buf: FrameBuffer, block_ids: list[list[int]],
               blocks_per_chunk: int) -> Any:
    """Gather chunks (rows of `block_ids`) into `buf`'s frames, on the caller's stream.

    On CUDA the gather and one bulk device-to-host copy are queued on the current stream and
    the event returned completes when `buf.host` holds the bytes; on CPU it is done on return
    (None). Either way the paged blocks may be reused by anything queued after this call.
    """
    n = len(block_ids)
    ids = torch.tensor(block_ids, dtype=torch.int64, device=paged.device)
    paged.gather(ids, paged.payload_view(buf.device_view, n, buf.stride, block.HEADER_SIZE,
                                         blocks_per_chunk))
    if not buf.mirrored:
        return None
    buf.to_host(n)
    ready = torch.cuda.Event()
    ready.record()
    return ready


class IOThread:
    def __init__(self, store: "TieredStore", paged: PagedKV, load_pool: StagingPool,
                 save_pool: StagingPool, blocks_per_chunk: int, payload_len: int,
                 stats: "KVTierStats", stats_lock: threading.Lock, hold_saves_s: float = 0.0,
                 idle_s: float = 0.0):
        """`hold_saves_s`: how long a save may wait while its request's prefill continues
        (`prefilling`), and for the end of the step that gathered it (`step_ended`; told
        or not, `idle_s` after the worker's part of the step: an idle engine); never once
        the engine would wait for a save buffer. A step goes on after the worker's part to
        sample its tokens (the first one, where a prefill ends): saves started then take
        the core and the GIL from it."""
        self.store, self.paged = store, paged
        self.load_pool, self.save_pool = load_pool, save_pool
        self.m, self.payload_len = blocks_per_chunk, payload_len
        self.stats, self.stats_lock = stats, stats_lock
        self.stream = torch.cuda.Stream(paged.device) if paged.device.type == "cuda" else None
        self._loads = LoadQueue()  # earliest deadline first
        self._saves: collections.deque[SaveBatch] = collections.deque()
        self._cv = threading.Condition()
        # The save thread waits on a condition of its own (the same lock), woken only when a
        # queued save may have become takeable: on a CPU cache every needless wakeup during
        # a prefill takes a core and the GIL from the forward.
        self._save_cv = threading.Condition(self._cv._lock)  # type: ignore[attr-defined]
        self._stop = False
        self._failed_reqs: set[str] = set()
        self._done_loads: list[str] = []
        self._failed_blocks: set[int] = set()
        self._loaded: dict[str, int] = {}        # chunks of a request's job loaded so far
        self._settled: list[tuple[str, int]] = []  # (request, chunks its job loaded)
        self._busy = 0
        self._hold_s = hold_saves_s
        self._prefilling: frozenset[str] = frozenset()
        self._idle_s = idle_s
        self._step = 0         # engine steps ended (`step_ended`)
        self._worked = -1      # the last step whose worker part is done (`prefilling`)
        self._worked_at = 0.0  # when it was done
        self._collects = 0  # times the engine collected finished loads (`collect`)
        self._overtime: dict[int, int] = {}  # id of a load past its deadline: `_collects` then
        self._threads = [threading.Thread(target=run, name=name, daemon=True)
                         for run, name in ((self._run_loads, "kvtier-io-load"),
                                           (self._run_saves, "kvtier-io-save"))]
        for thread in self._threads:
            thread.start()

    # ---- model-runner thread ------------------------------------------------------------

    def submit_load(self, batches: list[LoadBatch]) -> None:
        with self._cv:
            self._loads.extend(batches)
            self._cv.notify_all()  # the load thread, and an engine in `wait_for_load`

    def submit_save(self, batch: SaveBatch) -> None:
        with self._cv:
            batch.step = self._step
            # The save thread arms its hold timer when a save arrives in an empty queue;
            # later ones wake it only if the engine would wait for a buffer (a save goes
            # no sooner than the end of the step gathering it: `prefilling` wakes it then).
            wake = not self._saves or not self.save_pool.has_room()
            self._saves.append(batch)
            if wake:
                self._save_cv.notify()

    def prefilling(self, req_ids: Iterable[str]) -> None:
        """The worker's part of the step is done (its saves queued); `req_ids`: the requests
        whose prompts are still being computed after it."""
        if not self._saves:
            # Nothing queued (most decode steps): only this call writes these, and the save
            # thread reads them only for queued saves; no lock, nothing to wake.
            self._prefilling = frozenset(req_ids)
            self._worked, self._worked_at = self._step, time.perf_counter()
            return
        with self._cv:
            self._prefilling = frozenset(req_ids)
            self._worked, self._worked_at = self._step, time.perf_counter()
            if any(job.step == self._step and job.req_id not in self._prefilling
                   for job in self._saves):
                self._save_cv.notify()  # to time their wait: the step's end may go untold

    def step_ended(self) -> None:
        """The engine's step is over (its outputs are out, or the next step began): the
        saves it gathered may go, but for a prefill that goes on."""
        if self._worked != self._step:
            return  # no worker part since the last end: told twice, or no step ran
        if not self._saves:
            # Nothing to release, and nothing reads the count before a save is queued (two
            # callers racing here only skip a number: steps are compared, never counted).
            self._step += 1
            return
        with self._cv:
            if self._worked != self._step:
                return  # another caller ended this step meanwhile
            self._step += 1
            if any(job.req_id not in self._prefilling for job in self._saves):
                self._save_cv.notify()

    def load_now(self, batches: list[LoadBatch]) -> None:
        """Run a synchronous load's batches in the calling thread, now (the step's forward
        waits for them). Failed blocks are reported by `take_results` like any others."""
        for batch in batches:
            self._do(batch)

    def take_results(self) -> tuple[list[str], set[int], list[tuple[str, int]]]:
        """(requests whose loads all finished, blocks that failed, and (request, chunks
        loaded) for each load job that ended) since the last call."""
        with self._cv:
            done, failed, settled = self._done_loads, self._failed_blocks, self._settled
            self._done_loads, self._failed_blocks, self._settled = [], set(), []
            return done, failed, settled

    def wait_for_load(self, timeout_s: float) -> None:
        """Block until a request's loads finish, one passes its deadline, or `timeout_s`
        passes (if any are queued).

        The engine calls this on steps with nothing to compute: instead of spinning through
        empty steps (and holding the GIL the load thread needs), it sleeps until there is
        something to report (or to cut: `collect`).
        """
        with self._cv:
            if self._done_loads or not (self._loads or self._busy):
                return
            self._cv.wait_for(lambda: self._done_loads or self._uncut(), timeout_s)

    def collect(self, wait_s: float) -> None:
        """The engine is about to take the finished loads (`take_results`): a load past its
        deadline stops waiting for its transfer now, and this waits up to `wait_s` for such
        loads to be reported.

        An async load's failure reaches the scheduler only when the engine collects, at the
        end of the step in progress; cutting it at its deadline instead, mid-step, would
        save no time and lose what arrives before the step ends. So a load past its
        deadline keeps waiting for its transfer until the engine's next collection (or one
        more deadline's length at most), and what arrived by then counts.
        """
        with self._cv:
            if not self._overtime:
                return
            self._collects += 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._overtime, wait_s)

    def _uncut(self) -> bool:
        """A load is past its deadline and no collection has cut it yet; `_cv` held."""
        return any(seq == self._collects for seq in self._overtime.values())

    def idle(self) -> bool:
        with self._cv:
            return not (self._loads or self._saves or self._busy)

    def pending_saves(self) -> int:
        """Save batches queued, not yet started."""
        with self._cv:
            return len(self._saves)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish queued work (saves included), then end the threads."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            self._save_cv.notify_all()
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            log.warning("kvtier: I/O threads still busy after %.0fs at shutdown; queued saves "
                        "are abandoned (they become misses)", timeout_s)

    # ---- the threads --------------------------------------------------------------------

    def _run_loads(self) -> None:
        while True:
            with self._cv:
                while not self._loads:
                    if self._stop:
                        return
                    self._cv.wait()
                job = self._loads.pop()
                self._busy += 1
            self._run_job(job)

    def _run_saves(self) -> None:
        while True:
            with self._cv:
                while True:
                    ready = self._next_save()
                    if ready is not None:
                        job = self._take_save(ready)
                        break
                    if self._stop:  # nothing queued
                        return
                    self._save_cv.wait(self._wait_s() if self._saves else None)
                self._busy += 1
            self._run_job(job)

    def _run_job(self, job: LoadBatch | SaveBatch) -> None:
        try:
            self._do(job)
        finally:
            with self._cv:
                self._busy -= 1

    def _hold_left(self) -> float:
        """Seconds the oldest queued save may still wait for its prefill to end."""
        return max(0.0, self._saves[0].t0 + self._hold_s - time.perf_counter())

    def _step_left(self) -> float:
        """Seconds the step in progress still counts as going on when nobody tells its end:
        until its worker part is done, and `_idle_s` after that; `_cv` held."""
        if self._worked != self._step:
            return math.inf
        return max(0.0, self._worked_at + self._idle_s - time.perf_counter())

    def _wait_s(self) -> float:
        """Seconds until a queued save may go without anything else happening."""
        return min(self._hold_left(), self._step_left())

    def _waits(self, job: SaveBatch) -> bool:
        """Whether `job` waits: its request's prefill goes on, or the step that gathered
        it does (`_step_left`); `_cv` held."""
        return job.req_id in self._prefilling \
            or (job.step == self._step and self._step_left() > 0)

    def _next_save(self) -> int | None:
        """The position of the first queued save that need not wait, if any: one whose
        request's prefill is over and whose step has ended (`_waits`), or the oldest once
        it has waited `_hold_s`, the engine would wait for a save buffer, or the thread is
        stopping."""
        if not self._saves:
            return None
        if self._stop or self._hold_left() <= 0 or not self.save_pool.has_room():
            return 0
        return next((i for i, job in enumerate(self._saves) if not self._waits(job)), None)

    def _take_save(self, i: int) -> SaveBatch:
        """Dequeue the save at `i` (`_next_save`'s answer)."""
        job = self._saves[i]
        del self._saves[i]
        return job

    def _do(self, job: LoadBatch | SaveBatch) -> None:
        try:
            if isinstance(job, LoadBatch):
                self._load(job)
            else:
                self._save(job)
        except KVTierError as e:  # the store failed (e.g. its first tier is down)
            log.warning("kvtier: %s for request %s failed: %s", type(job).__name__,
                        job.req_id, e)
            self._fail(job)
        except Exception:  # a bug must not hang requests: fail the job, keep serving
            log.exception("kvtier: I/O job for request %s failed", job.req_id)
            self._fail(job)

    def _fail(self, job: LoadBatch | SaveBatch) -> None:
        """A load that raised loads nothing (vLLM recomputes); a save that raised is lost."""
        if isinstance(job, LoadBatch):
            self._finish_load(job, ok_rows=0)
            return
        with self.stats_lock:
            self.stats.add("save_failed_chunks", len(job.keys))

    def _load(self, job: LoadBatch) -> None:
        if job.req_id in self._failed_reqs:  # an earlier batch missed: nothing after it counts
            self._finish_load(job, ok_rows=0)
            return
        now = started = time.monotonic()
        if job.deadline is not None and job.grace_s and now + job.grace_s > job.deadline:
            # Late from the queue, not from its source: it gets its grace from now.
            job.deadline = now + job.grace_s
            with self.stats_lock:
                self.stats.add("load_late_starts")
        t0 = time.perf_counter()
        n = len(job.keys)
        got: list[int | None] = [None] * n
        for i, g in enumerate(self._load_in_place(job)):
            if g == self.payload_len:
                got[i] = g
        in_place = n - got.count(None)
        t1 = time.perf_counter()
        rest = [i for i in range(n) if got[i] is None]
        ok, late = n, 0
        if rest:
            ok, late = self._load_rest(job, got, rest)
        if late:
            # where the time went, to tell a slow source from a busy load thread or host
            log.warning("kvtier: a load of %d chunks for request %s passed its deadline "
                        "(%.0f ms after it was queued): %d recomputed; it waited %.0f ms for "
                        "the load thread and was cut %.0f ms after it started", n, job.req_id,
                        (job.deadline - job.queued) * 1e3, late,
                        (started - job.queued) * 1e3, (time.monotonic() - started) * 1e3)
        log.debug("kvtier: load %s: %d/%d chunks (%d in place, %.1f ms), the rest %.1f ms",
                  job.req_id, ok, n, in_place, (t1 - t0) * 1e3,
                  (time.perf_counter() - t1) * 1e3)
        with self.stats_lock:
            self.stats.add("load_chunks", ok)
            if late:
                self.stats.add("load_late_chunks", late)
            self.stats.add("load_in_place_chunks", ok - sum(i < ok for i in rest))
            self.stats.add("load_bytes", ok * self.payload_len)
            self.stats.observe_ms("load", (time.perf_counter() - t0) * 1e3)
        self._finish_load(job, ok_rows=ok)

    def _load_rest(self, job: LoadBatch, got: list[int | None], rest: list[int]
                   ) -> tuple[int, int]:
        """Read chunks `rest` through staging, by the job's deadline, and scatter the prefix
        that arrived; (chunks of the batch loaded, chunks that missed the deadline)."""
        n = len(job.keys)
        wait = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
        buf = self.load_pool.acquire(wait)
        if buf is None:  # every staging buffer is held by transfers past their deadline
            return next((i for i in range(n) if got[i] is None), n), len(rest)
        pending: tuple = ()
        late = 0
        try:
            keys = [job.keys[i] for i in rest]
            outs = [buf.frame(j) for j in range(len(rest))]
            where = None if job.tiers is None else [job.tiers[i] for i in rest]
            if job.deadline is None:
                part = self.store.load(keys, outs, where)
            else:
                parts = -(-len(rest) * buf.stride // PART_BYTES)
                # a sync load's step waits for it: the deadline is the cut
                overtime = None if job.sync else self._overtime_of(job)
                outcome = self.store.load_within(keys, outs, where, job.deadline, parts,
                                                 overtime)
                part, pending, late = outcome.lengths, outcome.pending, outcome.late
            for i, g in zip(rest, part):
                got[i] = g
            ok = next((i for i, g in enumerate(got) if g != self.payload_len), n)
            rows = [i for i in rest if i < ok]  # a prefix of `rest`, all read
            if rows:
                t0 = time.perf_counter()
                self._scatter(buf, job, rows)
                log.debug("kvtier: load %s: %d chunks read through staging, scattered in "
                          "%.1f ms", job.req_id, len(rows), (time.perf_counter() - t0) * 1e3)
        finally:
            self.load_pool.release_after(buf, pending)
        return ok, late

    def _overtime_of(self, job: LoadBatch):
        """`load_within`'s `overtime` for `job`: wait for the transfer in progress until
        the engine collects (`collect`) or one more deadline's length has passed."""
        def overtime(fut) -> None:
            fut.add_done_callback(lambda _f: self._notify())
            with self._cv:
                seq = self._overtime[id(job)] = self._collects
                self._cv.notify_all()  # an idle engine's `wait_for_load` collects at once
                self._cv.wait_for(lambda: fut.done() or self._collects != seq, job.span_s)
        return overtime

    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _load_in_place(self, job: LoadBatch) -> list[int]:
        """Scatter the chunks the store lets us read where they lie (another engine's pool
        segment, mapped from its file) straight into the paged cache, then have the store
        check them; payload length per chunk, `MISS` for those left to `store.load`.

        What is checked is what the cache now holds: its checksums of the scattered blocks
        (read where they lie; gathered into staging first where pages are not contiguous)
        against the header their key's frame has at check time. So a frame that changed
        while it was read (even one removed, its space reused, and the same key put back at
        the same place before the check) can never pass, and a chunk that fails is loaded
        again before any block is reported. Blocks of the first chunk already in the cache
        from a local hit are not scattered; their bytes for the check are the frame's. CPU
        caches only: a GPU reads through pinned staging."""
        if self.stream is not None:
            return []
        elem = self.paged.views[0].element_size()
        frame_len = block.HEADER_SIZE + self.payload_len
        runs = [r for r in self.store.locate(job.keys, job.tiers)
                if r.offset % elem == 0 and r.stride % elem == 0 and r.size == frame_len]
        if not runs:
            return []
        sums: list[int | None] = [None] * len(job.keys)
        for run in runs:
            with warnings.catch_warnings():  # the mapping is read-only; we only read it
                warnings.simplefilter("ignore", UserWarning)
                mem = torch.frombuffer(run.mem, dtype=torch.uint8)
            view = self.paged.payload_view(mem[run.offset:], run.count, run.stride,
                                           block.HEADER_SIZE, self.m)
            rows = job.block_ids[run.first:run.first + run.count]
            skip = job.skip_first if run.first == 0 else 0
            self.paged.scatter(torch.tensor(rows, dtype=torch.int64), view, skip)
            first = run.mem[run.offset + block.HEADER_SIZE:run.offset + frame_len]
            got = self.paged.checksums(rows, skip, first)
            if got is None:
                got = self._checksums_of_copy(rows, skip, view)
            sums[run.first:run.first + run.count] = got
        return self.store.confirm(job.keys, runs, sums)

    def _checksums_of_copy(self, rows: list[list[int]], skip: int,
                           view: torch.Tensor) -> list[int]:
        """`PagedKV.checksums` for layouts it cannot read where they lie: gather the blocks
        into staging (one memory pass more) and checksum each payload there."""
        buf = self.load_pool.acquire()
        try:
            out = self.paged.payload_view(buf.device_view, len(rows), buf.stride,
                                          block.HEADER_SIZE, self.m)
            self.paged.gather(torch.tensor(rows, dtype=torch.int64), out)
            if skip:
                out[0, :skip].copy_(view[0, :skip])
            return [block.payload_checksum(buf.frame(i)[block.HEADER_SIZE:
                                                        block.HEADER_SIZE + self.payload_len])
                    for i in range(len(rows))]
        finally:
            self.load_pool.release(buf)

    def _scatter(self, buf: FrameBuffer, job: LoadBatch, rows: list[int]) -> None:
        """Scatter staging frames 0.. into the blocks of the job's chunks `rows`."""
        view = self.paged.payload_view(buf.device_view, len(rows), buf.stride,
                                       block.HEADER_SIZE, self.m)
        skip = job.skip_first if rows[0] == 0 else 0
        block_ids = [job.block_ids[i] for i in rows]
        if self.stream is None:
            ids = torch.tensor(block_ids, dtype=torch.int64)
            self.paged.scatter(ids, view, skip)
            return
        with torch.cuda.stream(self.stream):  # everything below is ordered on the side stream
            ids = torch.tensor(block_ids, dtype=torch.int64, device=self.paged.device)
            buf.to_device(len(rows))
            self.paged.scatter(ids, view, skip)
        self.stream.synchronize()

    def _finish_load(self, job: LoadBatch, ok_rows: int) -> None:
        failed = set()
        for row, ids in enumerate(job.block_ids[ok_rows:], start=ok_rows):
            failed.update(ids[job.skip_first:] if row == 0 else ids)
        with self._cv:
            if self._overtime.pop(id(job), None) is not None:
                self._cv.notify_all()  # `collect` waits for these
            # After a failed batch every later one reports 0: the sum is the loaded prefix.
            self._loaded[job.req_id] = self._loaded.get(job.req_id, 0) + ok_rows
            if failed:
                self._failed_reqs.add(job.req_id)
                self._failed_blocks |= failed
            if job.last:
                self._settled.append((job.req_id, self._loaded.pop(job.req_id, 0)))
                self._failed_reqs.discard(job.req_id)
                if not job.sync:
                    self._done_loads.append(job.req_id)
                    self._cv.notify_all()
        if failed:
            with self.stats_lock:
                self.stats.add("load_error_blocks", len(failed))

    def _save(self, job: SaveBatch) -> None:
        try:
            if job.ready is not None:
                job.ready.synchronize()
            n = block.HEADER_SIZE + self.payload_len
            frames = [job.buf.frame(i)[:n] for i in range(len(job.keys))]
            for key, frame in zip(job.keys, frames):
                block.seal(frame, key, self.payload_len)
            stored = self.store.save(job.keys, frames, job.hint)
        finally:
            self.save_pool.release(job.buf)
        good = sum(stored)
        with self.stats_lock:
            self.stats.add("save_chunks", good)
            self.stats.add("save_bytes", good * self.payload_len)
            if good < len(stored):
                self.stats.add("save_failed_chunks", len(stored) - good)
            self.stats.observe_ms("save", (time.perf_counter() - job.t0) * 1e3)
        if good < len(stored):
            log.warning("kvtier: %d of %d chunks of request %s were not saved (future misses)",
                        len(stored) - good, len(stored), job.req_id)
