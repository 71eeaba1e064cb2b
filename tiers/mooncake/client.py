"""One Mooncake Store client per process: setup, registered buffers, codes, reconnection.

`MooncakeClient` owns the process's `MooncakeDistributedStore` for one tier. Callers run every
backend call inside `client.session()`, which yields the live store; they translate the codes
it returns with `classify` and report an unreachable backend with `client.fail(...)`, which
marks the client down and returns the `TierUnavailableError` to raise.

Contract:
- A call that finds the client down raises `TierUnavailableError` at once and starts a
  reconnect in the background (at most one at a time, one attempt per `RECONNECT_EVERY_S`):
  no request waits on it. If nothing answers at the master address the attempt fails after
  a TCP probe (no multi-second RPC retries inside Mooncake), or, with `master.embedded:
  true`, starts a master through `ensure_master`.
- Once a master answers, calls resume on the same store client as soon as it serves again:
  Mooncake's client remounts its segment on a restarted master by itself (~0.4 s, measured)
  and follows a new HA leader (`master.etcd`; the standby that took over knows that
  segment's objects, which a new client's empty segment would drop). A client is rebuilt
  (a fresh one set up, which mounts this process's segment and re-registers every
  registered buffer, then the old one closed once the calls still running on it return)
  only when it does not recover within `REBUILD_AFTER_S` (with HA: into one leader's term)
  or belongs to a pool service that is gone: Mooncake's `close()` holds the GIL for ~1-2 s,
  stalling every thread of the process (the engine's too).
- Buffers handed to `register` stay referenced (alive) until `close`.
- `setup` of a client whose master does not answer blocks for ~90 s inside Mooncake (20
  retries): a TCP probe always goes first.
- `mooncake.store` is imported here, lazily, with an install hint.

Measured (mooncake-transfer-engine-non-cuda 0.3.13.post1, loopback TCP): after the master is
killed, gets and `batch_is_exist` answer -900 at once and a put answers -900 after ~4 s of
retries; after it restarts the old client remounts its segment (a private one or a mounted
file) by itself within ~0.4 s, with puts answering -200 until then; objects of a client that
died answer -800 (transfer failed) for ~10 s (the master's client TTL), then -704; `close()`
takes ~2 s and holds the GIL throughout (a thread waking every millisecond beside it sees
one 1.75 s gap): replacing the client after each master restart froze the whole process
(the engine with it) for that long. A pool service's client stops answering (-900) once
the thread that set it up has exited.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from kvtier.store.base.block import alloc_aligned, buffer_address
from kvtier.store.base.config import MasterConfig, MooncakeTierConfig
from kvtier.store.base.errors import MasterError, TierError, TierUnavailableError
from kvtier.tiers.mooncake.ha import current_leader
from kvtier.tiers.mooncake.hostname import announced_host
from kvtier.tiers.mooncake.master import (INSTALL_HINT, ensure_master, master_answers,
                                          master_reachable)
from kvtier.tiers.mooncake.segments import LentFile

log = logging.getLogger(__name__)

OK = 0
NO_AVAILABLE_HANDLE = -200   # pool full and nothing evictable
INVALID_PARAMS = -600        # e.g. the buffer is smaller than the object
REPLICA_IS_NOT_READY = -703  # a put of this key is still in flight
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707         # evicted while we read it
TRANSFER_FAIL = -800         # the segment holding the object is gone (its client died)
RPC_FAIL = -900
PROBE_S = 0.2            # a master that accepts no connection in this long is unreachable
CLOSE_JOIN_S = 35.0      # close() waits this long for a reconnect closing the old client
RECONNECT_EVERY_S = 1.0  # while down: at most one background reconnect attempt this often

MISS_CODES = frozenset({REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, LEASE_EXPIRED, TRANSFER_FAIL})
# The master itself is unreachable or has forgotten us (restarted): reconnect.
DOWN_CODES = frozenset({-103, -1010, -1011}) | frozenset(range(-999, -899))


# How long calls may keep failing (with HA: into one leader's term) before the client is
# rebuilt rather than left to recover by itself (it remounts on a restarted master within
# ~0.4 s and follows a new leader within ~2 s, measured; this only catches one that never does).
REBUILD_AFTER_S = 30.0
READY_WAIT_S = 5.0   # a reconnect attempt probes the recovering client this long
READY_POLL_S = 0.05


def is_down(code: int) -> bool:
    return code in DOWN_CODES


def import_mooncake() -> Any:
    """The `mooncake.store` module, or a TierError naming the package to install."""
    try:
        import mooncake.store as mc
    except ImportError as e:
        raise TierError(f"cannot import mooncake.store ({e}); install it: {INSTALL_HINT}"
                        ) from None
    return mc


class _Handle:
    """A store client and the number of calls running on it, so it is closed only when idle."""

    def __init__(self, store: Any, lent: LentFile | None = None):
        self.store = store
        self.lent = lent  # the file its segment is lent from (`segment_dir`)
        self.active = 0
        self.cv = threading.Condition(threading.Lock())  # not the default RLock: cheaper

    def close_when_idle(self, timeout_s: float = 30.0) -> None:
        """Close the client once no call runs on it (at most `timeout_s` from now)."""
        with self.cv:
            self.cv.wait_for(lambda: self.active == 0, timeout_s)
        if self.lent is not None:
            self.lent.stop_fill()
        self.store.close()
        if self.lent is not None:
            self.lent.remove()


class _Session:
    """Holds a call on a handle (a plain class: @contextmanager costs ~5 us a call)."""

    __slots__ = ("handle",)

    def __init__(self, handle: _Handle):
        self.handle = handle

    def __enter__(self) -> Any:
        return self.handle.store

    def __exit__(self, *exc) -> None:
        handle = self.handle
        with handle.cv:
            handle.active -= 1
            if handle.active == 0:
                handle.cv.notify_all()


class MooncakeClient:
    """The process's store client for one mooncake tier (thread-safe)."""

    def __init__(self, cfg: MooncakeTierConfig, master: MasterConfig, lend: bool = True):
        self.cfg = cfg
        self.master = master
        self.lend = lend  # False: mount no segment (a client that only asks and reads)
        self.hostname: str | None = None  # what an embedded client announces (`hostname`)
        self.mc = import_mooncake()
        self.owned_master = None  # an EmbeddedMaster this client had to start
        self.owned_service = None  # a PoolService this client had to start
        self._lock = threading.Lock()  # serializes reconnects and registrations
        self._down = False
        self._retry_at = 0.0  # while down: no reconnect before this (time.monotonic())
        self._down_error = ""  # why calls fail while down (the failure, then the last attempt)
        # One long-lived thread: a pool service's client stops answering once the thread
        # that set it up has exited (measured: -900 on every call after).
        self._reconnector = ThreadPoolExecutor(1,
                                               thread_name_prefix=f"kvtier-{cfg.name}-reconnect")
        self._reconnecting: Future | None = None
        self._state_lock = threading.Lock()  # guards _reconnecting and _retry_at
        self._term: tuple[int, float] | None = None  # HA: (leader's term, first resume in it)
        self._down_since: float | None = None  # when calls started failing (non-HA)
        self._closed = False
        # Registered buffers sorted by address, as (starts, [(addr, nbytes, owner)]), replaced
        # whole on registration so lock-free readers never see the two lists out of step.
        self._regs: tuple[list[int], list[tuple[int, int, Any]]] = ([], [])
        # Registered scratch memory for frames in unregistered buffers (shared memory with
        # the pool service, replaced on each reconnect: a new service maps none of the old).
        self.staging: memoryview | None = None
        self._handle = _Handle(*self._new_store_lent())
        self.segment = self._segment_name(self._handle.store)  # where prefer_local puts
        self.replicate = self._replicate_config()

    # ---- connecting ----------------------------------------------------------------------

    def _where(self) -> str:
        if self.cfg.service:
            return f"pool service {self.cfg.service} (master {self.master.client_address})"
        return f"Mooncake master {self.master.client_address}"

    def _ensure_master(self) -> None:
        if master_reachable(self.master, PROBE_S):
            return
        if self.master.ha:
            raise TierUnavailableError(f"tier {self.cfg.name!r}: no {self._where()} leads; "
                                       "start masters with `kvtier master --ha`")
        if not self.master.embedded:
            raise TierUnavailableError(
                f"tier {self.cfg.name!r}: no {self._where()} answers; start one (`kvtier "
                "master`) or set master.embedded: true")
        try:
            owned = ensure_master(self.master)
        except MasterError as e:
            raise TierUnavailableError(f"tier {self.cfg.name!r}: {e}") from None
        self.owned_master = owned or self.owned_master

    def _master_endpoint(self) -> tuple[str, int]:
        """The master this host talks to, whose route picks the announced address: the
        address, or with HA masters the leader etcd names (an etcd endpoint while none does)."""
        where = self.master.address
        if self.master.ha:
            leader = current_leader(self.master.etcd)
            where = leader.address if leader else self.master.etcd[0]
        host, port = where.rsplit(":", 1)
        return host, int(port)

    def _new_store_lent(self) -> tuple[Any, LentFile | None]:
        """A connected store client, and the file it lends its segment from (if any)."""
        if not (self.cfg.segment_dir and self.lend and not self.cfg.service):
            return self._new_store(), None
        store = self._new_store(segment=False)
        lent = LentFile(self.cfg.segment_dir, self.cfg.capacity_bytes, self.cfg.name)
        try:
            got = store.mount_segment(str(lent.path), self.cfg.capacity_bytes, 0,
                                      self.cfg.protocol, "")
            if got.get("ret") != OK:
                raise TierUnavailableError(
                    f"tier {self.cfg.name!r}: mounting the segment file {lent.path} failed "
                    f"(code {got.get('ret')}) at {self._where()}; check the master's log")
            base = lent.base()
            lent.publish(self._own_endpoint(store, base), base)
            lent.fill(base)
        except BaseException:
            store.close()
            lent.remove()
            raise
        return store, lent

    def _own_endpoint(self, store: Any, base: int) -> str:
        """The transport endpoint the master names for this client's segment (replica
        descriptors carry it, not `get_hostname()`): read off a small object put there."""
        # A new key each time: after a reconnect the master may still hold the last probe,
        # in the segment this client lent before.
        key = f"kvtier-probe/{store.get_hostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        rc = self.mc.ReplicateConfig()
        rc.preferred_segment = store.get_hostname()
        code = store.put(key, bytes(4096), rc)
        descs = store.get_replica_desc(key) if code == OK else []
        for d in descs:
            if d.is_memory_replica():
                bd = d.get_memory_descriptor().buffer_descriptor
                if base <= bd.buffer_address < base + self.cfg.capacity_bytes:
                    return bd.transport_endpoint
        raise TierUnavailableError(f"tier {self.cfg.name!r}: a probe object put in this "
                                   f"process's segment file did not land in it (code {code}); "
                                   "drop segment_dir")

    def _new_store(self, segment: bool = True) -> Any:
        self._ensure_master()
        # Read by the transfer engine as it starts; the operator's own setting wins.
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC",
                              str(max(1, round(self.cfg.stall_timeout_s))))
        store = self.mc.MooncakeDistributedStore()
        if self.cfg.service:
            return self._join_service(store)
        if self.staging is None:
            self.staging = alloc_aligned(self.cfg.staging_bytes)
            self._add_reg(buffer_address(self.staging), len(self.staging), self.staging)
        cfg = self.cfg
        self.hostname = announced_host(cfg.local_hostname, *self._master_endpoint())
        rc = store.setup(self.hostname, self.master.metadata_server,
                         cfg.capacity_bytes if self.lend and segment else 0,
                         cfg.buffer_bytes, cfg.protocol, cfg.device,
                         self.master.client_address)
        if rc != OK:
            raise TierUnavailableError(
                f"tier {cfg.name!r}: Mooncake client setup failed (code {rc}) against "
                f"{self._where()} over {cfg.protocol}; check the master's log, "
                f"local_hostname={self.hostname!r} and device={cfg.device!r}")
        for addr, nbytes, _ in self._regs[1]:
            rc = store.register_buffer(addr, nbytes)
            if rc != OK:
                store.close()
                raise TierUnavailableError(f"tier {cfg.name!r}: re-registering a {nbytes}-byte "
                                           f"buffer failed (code {rc}) after reconnecting to "
                                           f"{self._where()}; restart the process")
        return store

    def _join_service(self, store: Any) -> Any:
        """Connect `store` to the node's pool service as a shared-memory client."""
        cfg = self.cfg
        from kvtier.tiers.mooncake.service import ensure_service
        if not master_answers(cfg.service):
            try:
                self.owned_service = ensure_service(cfg, self.master) or self.owned_service
            except MasterError as e:
                raise TierUnavailableError(f"tier {cfg.name!r}: {e}") from None
        rc = store.setup_dummy(cfg.buffer_bytes, cfg.buffer_bytes, cfg.service)
        if rc != OK:
            raise TierUnavailableError(
                f"tier {cfg.name!r}: joining the {self._where()} failed (code {rc}); check "
                "that the service runs as this user on this node and see its log")
        # Memory registered with an earlier service is not mapped in this one.
        self._regs = ([], [])
        self.staging = self._alloc_shared(store, cfg.staging_bytes)
        return store

    def _alloc_shared(self, store: Any, nbytes: int) -> memoryview:
        addr = store.alloc_from_mem_pool(nbytes)
        if not addr or store.register_buffer(addr, nbytes) != OK:
            raise TierUnavailableError(
                f"tier {self.cfg.name!r}: {nbytes} bytes of shared memory with the "
                f"{self._where()} could not be mapped; check /dev/shm space and ulimit -l")
        view = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")
        self._add_reg(addr, nbytes, view)
        return view

    def _segment_name(self, store: Any) -> str:
        """This client's segment; with a service, the service's (empty when unknown)."""
        if not self.cfg.service:
            return store.get_hostname() if self.lend else ""
        from kvtier.tiers.mooncake.service import read_segment
        name = read_segment(self.cfg.service, self.master.runtime_dir)
        if not name:
            log.warning("tier %r: the pool service at %s named no segment in %s (started by "
                        "hand, or with another master.run_dir): this process counts only "
                        "its own puts as the pool's usage and its puts do not prefer the "
                        "node's segment; give the node's processes and its service one "
                        "master.run_dir", self.cfg.name, self.cfg.service,
                        self.master.runtime_dir)
        return name

    def _replicate_config(self) -> Any:
        """Replication and soft pin from the policy, on whatever this API version offers."""
        rc = self.mc.ReplicateConfig()
        rc.replica_num = self.cfg.replicas
        if hasattr(rc, "soft_pin_action"):
            action = self.mc.SoftPinAction
            rc.soft_pin_action = action.ENABLE if self.cfg.soft_pin else action.DISABLE
        elif hasattr(rc, "with_soft_pin"):
            rc.with_soft_pin = self.cfg.soft_pin
        if hasattr(self.mc, "ObjectDataType") and hasattr(rc, "data_type"):
            rc.data_type = self.mc.ObjectDataType.KVCACHE
        if self.cfg.prefer_local and self.segment:
            # Measured on loopback: 4.5-5.8 GB/s into the own segment (memcpy) against
            # 1.4-1.8 GB/s into another client's segment (TCP).
            rc.preferred_segment = self.segment
        return rc

    def _start_reconnect(self) -> None:
        """Start a background reconnect unless one runs or the last attempt was too recent."""
        now = time.monotonic()
        with self._state_lock:
            if self._closed or self._reconnecting is not None or now < self._retry_at:
                return
            self._retry_at = now + RECONNECT_EVERY_S
            self._reconnecting = self._reconnector.submit(self._reconnect)

    def _reconnect(self) -> None:
        try:
            with self._lock:
                if self._closed or not self._down:
                    return
                if self._recovered():
                    self._down = False
                    self._down_since = None
                    log.warning("tier %r: %s answers; calls resume on the same client",
                                self.cfg.name, self._where())
                    return
                new = _Handle(*self._new_store_lent())
                old, self._handle = self._handle, new
                self.segment = self._segment_name(new.store)
                self.replicate = self._replicate_config()  # the new segment is the local one
                self._down = False
                self._down_since = None
            log.warning("tier %r: reconnected to %s with a new client", self.cfg.name,
                        self._where())
            old.close_when_idle()  # once the calls still running on it return
        except TierError as e:
            self._down_error = f"{e} (retried in the background)"
        except Exception as e:  # noqa: BLE001 - a bug must not end reconnecting for good
            log.exception("tier %r: reconnecting failed", self.cfg.name)
            self._down_error = f"tier {self.cfg.name!r}: reconnecting failed: {e}"
        finally:
            with self._state_lock:
                self._reconnecting = None

    def _recovered(self) -> bool:
        """Whether calls can resume on the same client; raise TierUnavailableError while no
        master answers (or the client's calls fail); False when it must be rebuilt."""
        if self.master.ha:
            if not self._follows_leader():
                return False
        else:
            self._ensure_master()
            if self.cfg.service:  # a pool service that went away: its client goes with it
                return (master_answers(self.cfg.service)
                        and self._serves(self._handle.store) is not False)
            if time.monotonic() - (self._down_since or time.monotonic()) > REBUILD_AFTER_S:
                return False
        until = time.monotonic() + READY_WAIT_S
        while (serves := self._serves(self._handle.store)) is not True:
            if time.monotonic() > until:
                if serves is None:  # calls are answered: a full pool looks the same
                    log.warning("tier %r: a probe put into this client's segment failed for "
                                "%gs (a full pool, or a segment not remounted yet); calls "
                                "resume", self.cfg.name, READY_WAIT_S)
                    return True
                raise TierUnavailableError(f"tier {self.cfg.name!r}: {self._where()} answers "
                                           "but this client's calls fail; retried")
            time.sleep(READY_POLL_S)
        return True

    def _serves(self, store: Any) -> bool | None:
        """Whether `store` serves again: False while the master does not answer its calls;
        None while a probe object cannot be put in its segment (puts answer -200 until it
        is remounted); True once it can, or when it lends no segment."""
        key = f"kvtier-probe/{self.hostname}/{os.getpid()}/{secrets.token_hex(4)}"
        if is_down(store.batch_is_exist([key])[0]):
            return False
        if not (self.lend and self.segment):
            return True
        if store.put(key, bytes(64), self.replicate) != OK:
            return None
        store.remove(key)
        return True

    def _follows_leader(self) -> bool:
        """HA: keep the store client (it follows the leader itself) once a leader answers;
        raise TierUnavailableError while none does; False when it must be rebuilt."""
        leader = current_leader(self.master.etcd)
        if leader is None or not master_answers(leader.address):
            raise TierUnavailableError(f"tier {self.cfg.name!r}: no {self._where()} leads; "
                                       "a standby takes over within ~10 s of a leader's loss")
        now = time.monotonic()
        if self._term is None or self._term[0] != leader.term:
            self._term = (leader.term, now)
        return now - self._term[1] < REBUILD_AFTER_S

    def session(self) -> "_Session":
        """A context manager yielding the live store client for one batch of calls; while
        the client is down, TierUnavailableError at once (a reconnect runs meanwhile)."""
        if self._closed:
            raise TierError(f"tier {self.cfg.name!r} is closed")
        if self._down:
            self._start_reconnect()
            raise TierUnavailableError(self._down_error)
        handle = self._handle
        with handle.cv:
            handle.active += 1
        return _Session(handle)

    def master_answers(self) -> bool:
        """Whether the master (in HA mode, the leader) accepts a connection now."""
        return master_reachable(self.master, PROBE_S)

    def fail(self, op: str, code: int | str) -> TierUnavailableError:
        """Mark the client down after `op` answered `code` (or a text saying what went
        wrong); return the error to raise."""
        self._down = True
        answering = master_reachable(self.master, PROBE_S)
        fix = ("the master answers again: reconnecting in the background" if answering else
               "a standby takes over within ~10 s; the client follows it" if self.master.ha
               else "start it again (`kvtier master`) or check the network; the client "
               "reconnects by itself")
        what = f"failed with code {code}" if isinstance(code, int) else code
        if self._down_since is None:
            self._down_since = time.monotonic()
        self._down_error = (f"tier {self.cfg.name!r}: {op} {what}: {self._where()} "
                            f"unreachable; {fix}")
        return TierUnavailableError(self._down_error)

    # ---- registered memory ---------------------------------------------------------------

    def register(self, buf) -> int | None:
        """Register `buf` (kept alive until close) for zero-copy transfers; return its address.

        With a pool service only memory from `alloc_shared` can be registered: for any other
        buffer this returns None, and transfers from it go through `staging`."""
        view = memoryview(buf)
        addr, nbytes = buffer_address(view), view.nbytes
        with self._lock:
            if self.registered(addr, nbytes):
                return addr
            if self.cfg.service:
                return None
            rc = self._handle.store.register_buffer(addr, nbytes)
            if rc != OK:
                raise TierError(f"tier {self.cfg.name!r}: register_buffer of {nbytes} bytes "
                                f"failed (code {rc}); use page-aligned memory "
                                "(block.alloc_aligned) and check the memlock limit (ulimit -l)")
            self._add_reg(addr, nbytes, view)
        return addr

    def alloc_shared(self, nbytes: int) -> memoryview:
        """Page-aligned memory registered for zero-copy transfers (shared with the pool service
        when there is one). After a reconnect to a new service it is no longer registered:
        transfers from it then go through `staging`, still correct."""
        if self.cfg.service:
            with self._lock:
                return self._alloc_shared(self._handle.store, nbytes)
        view = alloc_aligned(nbytes)
        self.register(view)
        return view

    def new_staging(self) -> memoryview:
        """Replace `staging` with a new registered area (the old one stays registered and
        alive for the call still using it, until close)."""
        with self._lock:
            store = self._handle.store
            if self.cfg.service:
                self.staging = self._alloc_shared(store, self.cfg.staging_bytes)
                return self.staging
            view = alloc_aligned(self.cfg.staging_bytes)
            rc = store.register_buffer(buffer_address(view), view.nbytes)
            if rc != OK:
                raise TierError(f"tier {self.cfg.name!r}: registering another staging area "
                                f"failed (code {rc}); check the memlock limit (ulimit -l)")
            self._add_reg(buffer_address(view), view.nbytes, view)
            self.staging = view
        return view

    def _add_reg(self, addr: int, nbytes: int, owner: Any) -> None:
        starts, bufs = self._regs
        i = bisect.bisect(starts, addr)
        self._regs = (starts[:i] + [addr] + starts[i:],
                      bufs[:i] + [(addr, nbytes, owner)] + bufs[i:])

    def registered(self, addr: int, nbytes: int) -> bool:
        """True if [addr, addr+nbytes) lies inside one registered buffer."""
        starts, bufs = self._regs
        i = bisect.bisect(starts, addr) - 1
        if i < 0:
            return False
        start, size, _ = bufs[i]
        return addr + nbytes <= start + size

    def close(self) -> None:
        """Close the store client (unmounts this process's segment). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handle = self._handle
        handle.close_when_idle()
        with self._state_lock:
            running = self._reconnecting
        if running is not None:  # it closes the client it replaced: let it finish
            wait([running], CLOSE_JOIN_S)
        self._reconnector.shutdown(wait=False)
        self._regs = ([], [])
