"""The `mooncake` tier: block frames in the cluster's pooled DRAM (a Mooncake Store).

One store client per process (`tiers.mooncake.client`) lends `capacity` bytes of this
process's memory to the pool and reads and writes objects wherever the master placed them.
Each block is one object: key = block key, value = the whole frame (header + payload).

Data path (batched Mooncake calls only):
- `contains`: one `batch_is_exist` (it also renews the master's lease on the keys).
- `put`: `batch_put_from`, with replication and soft pin from the policy. Frames that lie in
  registered memory (`register`) go straight from the caller's buffer; others are copied into
  the staging buffer registered once at open. A put is atomic per key in Mooncake (an object
  becomes visible at PutEnd, whole). A batch sends each key once; an existing key is stored
  (Mooncake answers 0 without a transfer), and counted in `puts` only if new to this process.
- `get`: `batch_get_into`, straight into registered out buffers, else into staging and one
  copy. Every frame is verified (`block.verify`; frames of 1 MiB and more on every core,
  `store.base.verify_pool`); one that fails is counted in `corrupt`, removed from the pool
  and from the index, and reported as MISS.
- `locate` / `verify_in_place` (with `segment_dir`): runs of frames lying at one stride in
  another process's segment file, handed out to be read where they lie, then checked
  (`tiers.mooncake.segments`); the connector scatters them straight into the paged cache and
  has its checksums of what landed there checked against the header the frame has then.
- Large batches run as a two-stage pipeline: the transfer of one chunk (in a worker thread;
  Mooncake releases the GIL) overlaps the checksum and copies of the chunk before it.

Codes: -704 / -703 / -707 are misses; -800 (the segment holding the object belongs to a client
that died; the master forgets it after its client TTL) is a miss counted in `errors`; -600 (the
object is larger than the caller's out buffer) is the caller's ValueError, the block kept; -200
(pool full, nothing evictable) is retried with exponential back-off from `retry_backoff_s`,
then raised as `TierFullError`; a master that does not answer is `TierUnavailableError`, and
the client reconnects in the background (see `client`). While an earlier lookup that passed
`call_timeout_s` still runs (a hung master: Mooncake's RPC gives up after ~30 s), `contains`
skips the pool at once instead of waiting the timeout again.

Objects live in the segments of the clients that lent them: when a process exits, the blocks
in its segment go away. `delete` forces removal past the master's read lease: a reader racing
a delete can only see a torn frame, which verification turns into a miss.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from kvtier.store.base.block import (HEADER_SIZE, KEY_AT, KEY_LEN, buffer_address, parse_header,
                                     verify, verify_used)
from kvtier.store.base.config import MooncakeTierConfig
from kvtier.store.base.errors import CorruptBlockError, TierError, TierUnavailableError
from kvtier.store.base.verify_pool import copied_verified_lens, verified_lens
from kvtier.tiers.base import MISS, InPlaceRun, Tier, full_error
from kvtier.tiers.bounded import BoundedCalls, Unanswered
from kvtier.tiers.mooncake import check as mooncake_check
from kvtier.tiers.mooncake.client import (INVALID_PARAMS, MISS_CODES, NO_AVAILABLE_HANDLE,
                                          OK, TRANSFER_FAIL, MooncakeClient, is_down)
from kvtier.tiers.mooncake.pipeline import (MIN_CHUNK_BYTES, SERVICE_MIN_CHUNK_BYTES, Chunk,
                                           plan_chunks, run_pipeline, worth_pipelining)
from kvtier.tiers.mooncake.hostname import host_of
from kvtier.tiers.mooncake.lenders import Lenders
from kvtier.tiers.mooncake.segments import Segments
from kvtier.tiers.mooncake.usage import PoolUsage

FULL_RETRIES = 4            # back-off steps on -200 before TierFullError
ALREADY_EXISTS = -705
MIN_RUN = 8                 # fewer frames at one stride are copied, not read in place
PROBE_EVERY = 16            # a predicted run is checked at every 16th frame's key
TRANSFER_THREADS = 4        # transfers of concurrent calls in flight at once
LOOKUP_THREADS = 2          # lookups in flight at once (one may hang on a cut link)
# While a lookup that had no answer in `call_timeout_s` is still running (a hung master, a
# busy host), later lookups skip the pool at once, for at most this long.
HUNG_SKIP_S = 5.0
STAGING_POLL_S = 0.05       # a call waiting for staging looks for a new area this often
MAX_SPARE_STAGING = 2       # staging areas added for calls stuck behind late transfers


class MooncakeTier(Tier):
    """Block frames in the Mooncake pool through this process's store client."""

    kind = "mooncake"
    evicts_by_all_reads = True  # the master, in lease order, at its own high watermark

    def __init__(self, cfg: MooncakeTierConfig, ctx):
        super().__init__(cfg.name, cfg.capacity_bytes)
        self.cfg = cfg
        self.ctx = ctx
        self.client = MooncakeClient(cfg, ctx.master, lend=ctx.lend)
        self._stage_lock = threading.Lock()
        self._staging_locks: dict[int, threading.Lock] = {}  # per staging area, by address
        self._spares = 0  # staging areas added beside ones held by late transfers
        # False sends every transfer through staging, registered or not (benchmarks, debugging).
        self.zero_copy = True
        # Several: a transfer stuck on a stalled lender must not hold up the next call.
        self._worker = ThreadPoolExecutor(TRANSFER_THREADS,
                                          thread_name_prefix=f"kvtier-{cfg.name}")
        self._lookups = BoundedCalls(cfg.name, LOOKUP_THREADS, cfg.call_timeout_s,
                                     HUNG_SKIP_S)
        self.usage = PoolUsage(cfg.capacity_bytes, self.client, ctx.master)
        self.unreachable = Lenders()
        # Other processes' segments of this node, read straight from their files.
        self.segments = (Segments(cfg.segment_dir, self.client.hostname)
                         if cfg.segment_dir else None)
        if self.segments is not None and ctx.lend:
            # an engine's worker reads from its node's lenders: map them before its first hit
            self.segments.map_all()

    @property
    def staging(self) -> memoryview:
        """The client's registered scratch buffer (replaced when it reconnects to a service)."""
        return self.client.staging

    # ---- the contract --------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        # Bounded: a master across a cut link answers nothing for ~30 s (Mooncake's RPC
        # timeout), and a lookup must never cost more than the recompute it could save.
        try:
            codes = self._lookups.run(self._exist, list(keys))
        except Unanswered as e:
            if not e.waited:
                raise TierUnavailableError(f"tier {self.cfg.name!r}: an earlier "
                                           "batch_is_exist has not answered yet (past "
                                           "call_timeout_s); this call skips the pool"
                                           ) from None
            what = f"had no answer within {self.cfg.call_timeout_s:g}s (call_timeout_s)"
            if self.client.master_answers():
                # slow, not gone (a master that accepts connections but hangs, a
                # busy host): a miss this once, the client kept
                raise TierUnavailableError(f"tier {self.cfg.name!r}: batch_is_exist {what}; "
                                           "the master answers: this call skips the pool"
                                           ) from None
            raise self.client.fail("batch_is_exist", what) from None
        out = []
        for key, code in zip(keys, codes):
            if is_down(code):
                raise self.client.fail("batch_is_exist", code)
            if code < 0:
                self.stats.add(errors=1)
            out.append(code == 1)
        blocked = self.unreachable.blocked()
        if blocked and any(out):
            self._drop_blocked(keys, out, blocked)
        self.usage.forget([k for k, hit in zip(keys, out) if not hit])
        return out

    def _drop_blocked(self, keys: Sequence[str], present: list[bool], blocked: set[str]
                      ) -> None:
        """Answer as misses the blocks whose every copy lies with a lender this process
        could not read from lately (`tiers.mooncake.lenders`): promised, they would fail."""
        idx = [i for i, hit in enumerate(present) if hit]
        ends = self.lenders_of([keys[i] for i in idx])
        for i, lenders in zip(idx, ends):
            if lenders and all(e in blocked for e in lenders):
                present[i] = False

    def lenders_of(self, keys: list[str]) -> list[list[str]]:
        """The endpoints holding a memory copy of each key, as the master says (none for a
        key it does not know, or for all when it cannot say). Through a pool service, none:
        every block lies in the service's one segment, and the service answers no replica
        query (each try would log an RPC error in the engine's log)."""
        if self.cfg.service:
            return [[] for _ in keys]
        try:
            with self.client.session() as store:
                descs = store.batch_get_replica_desc(keys)
        except Exception:  # noqa: BLE001 - a master that cannot say names no lender
            descs = {}
        return [[d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                 for d in descs.get(key, ()) if d.is_memory_replica()] for key in keys]

    def _exist(self, keys: list[str]) -> list[int]:
        with self.client.session() as store:
            return store.batch_is_exist(keys)

    def put(self, keys: Sequence[str], frames: Sequence[memoryview]) -> list[bool]:
        _check_lengths(keys, frames)
        views = [_byte_view(f) for f in frames]
        sizes = [_frame_len(k, v) for k, v in zip(keys, views)]
        if len(set(keys)) == len(keys):
            return self._put_unique(list(keys), views, sizes)
        first: dict[str, int] = {}  # a batch sends each key once
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        idx = list(first.values())
        got = self._put_unique(list(first), [views[i] for i in idx], [sizes[i] for i in idx])
        stored = dict(zip(first, got))
        return [stored[k] for k in keys]

    def _put_unique(self, keys: list[str], views: list[memoryview],
                    sizes: list[int]) -> list[bool]:
        done = [False] * len(keys)
        todo, delay = list(range(len(keys))), self.cfg.retry_backoff_s
        for attempt in range(FULL_RETRIES + 1):
            if len(todo) == len(keys):
                codes = self._transfer("put", keys, views, sizes)
            else:
                codes = self._transfer("put", [keys[i] for i in todo],
                                       [views[i] for i in todo], [sizes[i] for i in todo])
            full = []
            for i, code in zip(todo, codes):
                done[i] = code in (OK, ALREADY_EXISTS)  # an existing key: no transfer, 0
                if code == NO_AVAILABLE_HANDLE:
                    full.append(i)
                elif not done[i]:
                    self.stats.add(errors=1)
            new, nbytes = self.usage.stored([keys[i] for i in todo if done[i]],
                                            [sizes[i] for i in todo if done[i]])
            if new:  # Mooncake answers 0 for a key it holds: count keys new to this process
                self.stats.add(puts=new, bytes_in=nbytes)
            if not full:
                return done
            if attempt == 0:
                self.usage.refused()
            todo = full
            if attempt < FULL_RETRIES:
                time.sleep(delay)  # the master evicts at its high watermark, asynchronously
                delay *= 2
        raise full_error(self.name, f"the pool has nothing evictable: every object is leased "
                         f"or pinned; {len(todo)} of {len(keys)} blocks not stored",
                         "lend the pool more memory (capacity) or demote blocks to a lower tier",
                         [k for k, ok in zip(keys, done) if ok])

    def get(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[int]:
        _check_lengths(keys, outs)
        if not keys:
            return []
        views = [_byte_view(o) for o in outs]
        result = [MISS] * len(keys)
        corrupt: list[str] = []
        too_small: list[int] = []
        failed: list[str] = []

        def check(items: list[tuple[int, int, memoryview]]) -> None:
            """Verify the frames a call read, (index, code, frame) each (`verify_pool`: large
            frames on every core)."""
            read = [(i, code, frame) for i, code, frame in items if code >= 0]
            lens = verified_lens([f[:c] for _, c, f in read], [keys[i] for i, _, _ in read],
                                 [c for _, c, _ in read])
            for (i, _, _), n in zip(read, lens):
                if n is None:
                    corrupt.append(keys[i])
                else:
                    result[i] = n
            for i, code, _ in items:
                if code == INVALID_PARAMS:  # the object is larger than the caller's buffer
                    too_small.append(i)
                elif code < 0 and (code == TRANSFER_FAIL or code not in MISS_CODES):
                    self.stats.add(errors=1)  # -800: the client lending that segment is gone
                    failed.append(keys[i])

        # Each key once: Mooncake's batch_get_into fills only the last buffer of a key that
        # appears twice in a batch, yet answers success for every occurrence.
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        uniq = list(first.values())
        if self.segments is not None:
            uniq = self._get_direct(keys, views, uniq, result)
        if uniq:
            self._transfer("get", [keys[i] for i in uniq], [views[i] for i in uniq],
                           [len(views[i]) for i in uniq],
                           lambda items: check([(uniq[j], c, f) for j, c, f in items]))
        too_small = self._sound_frames(keys, too_small, corrupt)
        if failed:
            self._blame(failed)
        if corrupt:
            self._quarantine(corrupt)
        if too_small:
            # A caller's sizing bug, not a reason to wipe a block the whole cluster shares
            # (a namespace fixes its frame size); as the file tiers do, refuse loudly.
            i = too_small[0]
            raise ValueError(f"out buffer of {len(views[i])} bytes is smaller than the stored "
                             f"frame of {keys[i]} ({len(too_small)} such); size out buffers "
                             "for the namespace's frame (HEADER_SIZE + block bytes)")
        for i, key in enumerate(keys):
            src, n = first[key], result[first[key]]
            if src != i and n != MISS:
                views[i][:HEADER_SIZE + n] = views[src][:HEADER_SIZE + n]
                result[i] = n
        self.stats.add_reads(result, corrupt=len(corrupt))
        self.usage.forget([k for k, n in zip(keys, result) if n == MISS])
        if self.cfg.count_lender_hosts:
            self._count_cross_host([k for k, n in zip(keys, result) if n != MISS])
        return result

    def _host(self) -> str:
        """The host this process announces (with a pool service: the service's)."""
        return self.client.hostname or host_of(self.client.segment or "")

    def _count_cross_host(self, keys: list[str]) -> None:
        here = self._host()
        cross = sum(1 for ends in self.lenders_of(keys) if ends and host_of(ends[0]) != here)
        if cross:
            self.stats.add(cross_host_hits=cross)

    def lender_failures(self) -> dict[str, int]:
        return self.unreachable.counts()

    def blame_late(self, keys: Sequence[str]) -> None:
        self._spare_staging()
        # in a thread of its own: the caller is a request past its deadline
        threading.Thread(target=self._blame, args=(list(keys), True), daemon=True,
                         name=f"kvtier-{self.name}-blame").start()

    def _blame(self, keys: list[str], late: bool = False) -> None:
        """Count `keys` against the lenders the master says hold them (`unknown` when it
        names none: the object or its lender is gone), and mark those lenders (for a late
        load, only those on other hosts: `tiers.mooncake.lenders`)."""
        found: collections.Counter[str] = collections.Counter(
            ends[0] if ends else "unknown" for ends in self.lenders_of(keys))
        here = self._host()
        self.unreachable.fail(found, {e for e in found if host_of(e) != here} if late
                              else True)

    def _get_direct(self, keys: Sequence[str], views: list[memoryview], todo: list[int],
                    result: list[int]) -> list[int]:
        """Copy the blocks that lie in segment files of this node straight out of them
        (`tiers.mooncake.segments`); returns the indices left for the transfer. A block not
        found, in another node's segment, or whose frame fails its check goes the usual
        way (which tells a miss, an error and a corrupt block apart)."""
        places = self._places([keys[i] for i in todo])
        if places is None:
            return todo
        left, found, srcs = [], [], []
        for i, place in zip(todo, places):
            if place is None or place[2] > len(views[i]):
                left.append(i)
            else:
                mem, off, n = place
                found.append(i)
                srcs.append(mem[off:off + n])
        lens = copied_verified_lens([views[i] for i in found], srcs, [keys[i] for i in found])
        bad = [i for i, n in zip(found, lens) if n is None]
        for i, n in zip(found, lens):
            if n is not None:
                result[i] = n
        if bad:
            # a bad frame, a frame overwritten meanwhile, or a stale mapping (a new lender at
            # the same endpoint)
            self.segments.recheck()
        return sorted(left + bad)

    def _places(self, keys: Sequence[str]) -> list[tuple[memoryview, int, int] | None] | None:
        """Where each block lies in a segment file of this node: (the mapped segment, the
        frame's offset in it, its length), or None; None for all when the master cannot
        say. The query leases the blocks: the master neither evicts nor moves them for a
        few seconds (a forced `delete` still can; readers verify what they read)."""
        try:
            with self.client.session() as store:
                descs = store.batch_get_replica_desc(list(keys))
        except Exception:  # noqa: BLE001 - the transfer path reports what is wrong
            return None
        # Every attribute of a descriptor is a pybind call, and 511 keys are a 16K-token
        # hit: one segment lookup per endpoint, and no look at the replica's status (a
        # replica still being written fails the reader's check like any torn frame).
        segs: dict[str, tuple[memoryview, int] | None] = {}
        out: list[tuple[memoryview, int, int] | None] = []
        for key in keys:
            place = None
            for d in descs.get(key, ()):
                if d.is_memory_replica():
                    bd = d.get_memory_descriptor().buffer_descriptor
                    endpoint = bd.transport_endpoint
                    if endpoint not in segs:
                        segs[endpoint] = self.segments.view(endpoint)
                    if segs[endpoint] is not None:
                        mem, base = segs[endpoint]
                        off, n = bd.buffer_address - base, bd.size
                        if 0 <= off and off + n <= len(mem):
                            place = (mem, off, n)
                        break
            out.append(place)
        return out

    def locate(self, keys: Sequence[str]) -> list[InPlaceRun]:
        """Runs of consecutive `keys` whose frames lie at one stride in a segment file of
        this node, to be read where they lie (no copy); blocks outside every run are left to
        `get`. Only runs of `MIN_RUN` blocks or more are worth it (each is one batched op
        for the caller). What a run holds is unverified until `verify_in_place` says so.
        """
        if (self.segments is None or not self.cfg.read_in_place or len(keys) < MIN_RUN
                or len(set(keys)) != len(keys)):
            return []
        run = self._predict(keys)
        if run is not None:
            return [run]
        places = self._places(keys)
        return [] if places is None else _runs(places)

    def _predict(self, keys: Sequence[str]) -> InPlaceRun | None:
        """One run over all `keys`, from where the first and the last lie, if frames spaced
        evenly between them hold the keys' headers at every `PROBE_EVERY`-th place (what a
        batch put leaves in a segment): two descriptors instead of one per key, which cost
        ~2 ms at 511 keys. A frame the prediction gets wrong fails `verify_in_place`."""
        ends = self._places([keys[0], keys[-1]])
        if ends is None or ends[0] is None or ends[1] is None:
            return None
        (mem, first, size), (mem_last, last, size_last) = ends
        n = len(keys)
        stride, rem = divmod(last - first, n - 1)
        if mem_last is not mem or size_last != size or rem or stride < size:
            return None
        for j in (*range(1, n - 1, PROBE_EVERY), n - 2):
            at = first + j * stride + KEY_AT
            if mem[at:at + KEY_LEN] != bytes.fromhex(keys[j]):
                return None
        return InPlaceRun(0, n, mem, first, stride, size)

    def verify_in_place(self, keys: Sequence[str], runs: Sequence[InPlaceRun],
                        checksums: Sequence[int | None]) -> list[int]:
        """Check what the caller read from `runs`; payload length per key, `MISS` for a key
        outside the runs or whose frame failed (overwritten since, or bad: `get` reads it
        again the usual way, which quarantines a bad one).

        `checksums[i]` is the caller's checksum of the payload it used for key `i`,
        computed where it put it: that must be what the header the key's frame has now
        seals. So what passes is byte for byte a payload stored under the key, whatever the
        segment went through; a check of the frame where it lies could not see one replaced
        and put back while it was read."""
        result = [MISS] * len(keys)
        failed = 0
        for run in runs:
            plen = run.size - HEADER_SIZE
            for j in range(run.count):
                i, off = run.first + j, run.offset + j * run.stride
                try:
                    verify_used(run.mem[off:off + HEADER_SIZE], keys[i], plen, checksums[i])
                    result[i] = plen
                except CorruptBlockError:
                    failed += 1
        if failed:
            self.segments.recheck()
        hits = [n for n in result if n != MISS]
        self.stats.add(hits=len(hits), in_place=len(hits),
                       bytes_out=sum(hits) + HEADER_SIZE * len(hits))
        return result

    def delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        with self.client.session() as store:
            codes = store.batch_remove(list(keys), True)
        removed = 0
        for code in codes:
            if is_down(code):
                raise self.client.fail("batch_remove", code)
            removed += code == OK
        self.usage.forget(keys)
        self.usage.refresh()  # the master's reading predates the removal
        self.stats.add(deletes=removed)
        return removed

    def used_bytes(self) -> int:
        return self.usage.used_bytes()

    def usable_bytes(self) -> int:
        return self.usage.usable_bytes()

    def own_share(self, used: int) -> float:
        return self.usage.own_share(used)

    def check(self, progress=None):
        return mooncake_check.check(self, progress)

    def repair(self, problems) -> int:
        return mooncake_check.repair(self, problems)

    def register(self, buf) -> None:
        """Register `buf` so puts from it and gets into it skip the staging copy (with a pool
        service only `alloc_shared` memory can be; others keep the copy)."""
        self.client.register(buf)

    def alloc_shared(self, nbytes: int) -> memoryview:
        """Page-aligned memory the pool moves frames to and from without a copy."""
        return self.client.alloc_shared(nbytes)

    def close(self) -> None:
        self._lookups.close()  # a lookup left hanging ends with its RPC
        self._worker.shutdown(wait=True)
        self.client.close()
        if self.segments is not None:
            self.segments.close()

    # ---- transfers -----------------------------------------------------------------------

    def _transfer(self, op: str, keys: Sequence[str], views: list[memoryview],
                  sizes: list[int], check=None) -> list[int]:
        """Run a batched put or get over direct and staged chunks; return per-key codes."""
        # Registrations and staging are read inside the session: a reconnect to a new pool
        # service replaces both.
        with self.client.session() as store:
            return self._transfer_on(store, op, keys, views, sizes, check)

    def _transfer_on(self, store, op: str, keys: Sequence[str], views: list[memoryview],
                     sizes: list[int], check) -> list[int]:
        addrs = [buffer_address(v) for v in views]
        registered = self.client.registered
        direct = [self.zero_copy and registered(a, n) for a, n in zip(addrs, sizes)]
        call = "batch_put_from" if op == "put" else "batch_get_into"
        min_chunk = SERVICE_MIN_CHUNK_BYTES if self.cfg.service else MIN_CHUNK_BYTES
        if all(direct) and (op == "put" or not worth_pipelining(sum(sizes), min_chunk)):
            # One call, nothing to stage or to overlap: skip the pipeline's bookkeeping,
            # which is a sizeable share of a 256 KiB call (~0.1-0.2 ms in Mooncake).
            codes = (store.batch_put_from(list(keys), addrs, sizes, self.client.replicate)
                     if op == "put" else store.batch_get_into(list(keys), addrs, sizes))
            for code in codes:
                if is_down(code):
                    raise self.client.fail(call, code)
            if check is not None:
                check([(i, code, views[i]) for i, code in enumerate(codes)])
            return codes
        chunks = plan_chunks(sizes, direct, len(self.client.staging), merge_direct=(op == "put"),
                             min_chunk=min_chunk)
        codes = [0] * len(keys)
        staged = any(c.staged for c in chunks)
        # the staging area this call holds (taken below: another may replace the current one)
        staging = self._take_staging() if staged else self.client.staging
        staging_addr = buffer_address(staging)

        def xfer(chunk: Chunk) -> list[int]:
            ptrs = ([staging_addr + off for off in chunk.offsets] if chunk.staged
                    else [addrs[i] for i in chunk.idx])
            ks, ns = [keys[i] for i in chunk.idx], [sizes[i] for i in chunk.idx]
            if op == "put":
                return store.batch_put_from(ks, ptrs, ns, self.client.replicate)
            return store.batch_get_into(ks, ptrs, ns)

        def pre(chunk: Chunk) -> None:  # put: copy frames into staging
            if op == "put" and chunk.staged:
                for i, off in zip(chunk.idx, chunk.offsets):
                    staging[off:off + sizes[i]] = views[i][:sizes[i]]

        def post(chunk: Chunk, got: list[int]) -> None:
            items = []
            for j, (i, code) in enumerate(zip(chunk.idx, got)):
                codes[i] = code
                if is_down(code):
                    raise self.client.fail(call, code)
                if check is None:
                    continue
                frame = views[i]
                if chunk.staged and code > 0:  # staged get: one copy out
                    off = chunk.offsets[j]
                    frame[:code] = staging[off:off + code]
                items.append((i, code, frame))
            if items:
                check(items)

        try:
            run_pipeline(self._worker, chunks, xfer, pre, post, len(staging))
        finally:
            if staged:
                self._staging_locks[buffer_address(staging)].release()
        return codes

    def _take_staging(self) -> memoryview:
        """The current staging area, locked for this call. One call at a time uses an area;
        a call abandoned by its load's deadline keeps its area until its transfer ends, and
        `_spare_staging` gives the others a new one meanwhile."""
        while True:
            staging = self.client.staging
            addr = buffer_address(staging)
            with self._stage_lock:
                lock = self._staging_locks.setdefault(addr, threading.Lock())
            if lock.acquire(timeout=STAGING_POLL_S):
                if self.client.staging is staging:
                    return staging
                lock.release()  # replaced while we waited: take the new one

    def _spare_staging(self) -> None:
        """A late load may hold the staging area until its transfer gives up (a cut link:
        tens of seconds); let the tier's other calls stage through a fresh one."""
        staging = self.client.staging
        with self._stage_lock:
            lock = self._staging_locks.get(buffer_address(staging))
            if lock is None or not lock.locked() or self._spares >= MAX_SPARE_STAGING:
                return
            self._spares += 1
        try:
            self.client.new_staging()
        except TierError:
            pass  # no memory for another: calls wait for the area, as before

    # ---- bookkeeping ---------------------------------------------------------------------

    def _sound_frames(self, keys: Sequence[str], idx: list[int], corrupt: list[str]
                      ) -> list[int]:
        """Of objects too big for their out buffers, those that are whole frames of their key
        (the caller's sizing bug); the others (junk after a frame, a forged header) go to
        `corrupt`. Read whole, one by one: this is an error path."""
        sound = []
        with self.client.session() as store:
            for i in idx:
                obj = store.get(keys[i])
                try:
                    verify(obj, keys[i])
                    if parse_header(obj).frame_len != len(obj):
                        raise CorruptBlockError("bytes after the frame")
                    sound.append(i)
                except CorruptBlockError:
                    corrupt.append(keys[i])
        return sound

    def _quarantine(self, keys: list[str]) -> None:
        """Drop corrupt objects from the pool and the node's index (never returned)."""
        with self.client.session() as store:
            store.batch_remove(keys, True)
        if self.ctx.index is not None:
            self.ctx.index.delete(self.name, keys)
        self.usage.forget(keys)


def _frame_len(key: str, view: memoryview) -> int:
    """The length of the sealed frame at the start of `view`; ValueError on a caller's bug."""
    header = parse_header(view)
    if header.key != key:
        raise ValueError(f"frame sealed for {header.key}, not {key}; seal it for its key")
    if len(view) < header.frame_len:
        raise ValueError(f"frame of {len(view)} bytes is shorter than its header says "
                         f"({header.frame_len}); pass the whole sealed frame")
    return header.frame_len


def _byte_view(buf) -> memoryview:
    """A flat unsigned-byte view of `buf` (slices then count bytes, whatever its format)."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _check_lengths(keys: Sequence[str], bufs: Sequence) -> None:
    if len(keys) != len(bufs):
        raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers; pass one buffer per key")


def _runs(places: Sequence[tuple[memoryview, int, int] | None]) -> list[InPlaceRun]:
    """Maximal runs of consecutive places in one mapping at one stride, `MIN_RUN` or longer."""
    runs: list[InPlaceRun] = []
    i = 0
    while i < len(places):
        if places[i] is None:
            i += 1
            continue
        mem, off, size = places[i]
        j = i + 1
        stride = places[j][1] - off if j < len(places) and places[j] is not None else 0
        while (j < len(places) and places[j] is not None and places[j][0] is mem
               and places[j][2] == size and places[j][1] == off + (j - i) * stride
               and stride >= size):
            j += 1
        if j - i >= MIN_RUN:
            runs.append(InPlaceRun(i, j - i, mem, off, stride, size))
        i = j
    return runs
