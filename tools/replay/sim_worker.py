"""One simulated instance's store: a process with its own `TieredStore`, as a vLLM instance is.

Each simulated instance runs in its own process (`SimWorker`), with its own store client
lending its own pool segment, its own index and nvme dir, exactly as the connector inside a
vLLM process. Real blocks move: frames of `payload_bytes` (the tiny model's KV per chunk)
are sealed, saved, looked up, loaded and verified through the same `TieredStore` calls the
connector makes:
- `request(keys, local, hint, now)`: one lookup of the whole chain (the store attaches the
  request to its session by it), then a load of the hit beyond vLLM's local hit, `local`
  blocks (the connector's `get_num_new_matched_tokens` + worker load). Every loaded frame is
  checked against its key: `save` writes the key into the first 48 payload bytes, so a frame
  the store hands back for key K that does not start with K is a wrong block served (counted,
  never used). A block that fails to load or to check ends the hit there (vLLM recomputes
  from it). Returns (hit blocks, the tier of each loaded block, load seconds, wrong blocks).
- `save(keys, all_keys, hint, now)`: write-through of the new chunks, then `finish` with the
  looked-up keys (the end of the turn).
- `host`: the network namespace the instance's process enters first (`tools.hosts`: one of
  several hosts on this machine); `deadline_s`: loads give up after this many seconds of
  wall time (`TieredStore.load_within`: a lender cut off never holds a request), what is
  not in by then is a miss.
For the soak (`tools.replay.soak.run`): `counters()` (each tier's counters), `frames(tier, n,
seed)` (where `n` random stored frames of a tier lie: what a fault may corrupt) and
`scrub(tier, keys)` (read those keys from that tier alone, so corrupt frames are found and
quarantined; wrong bytes are counted); `SimWorker.kill()` and `call(..., kill_after_s=)`
SIGKILL the process (mid-call with the latter, if the reply has not come by then).
Time is the coordinator's virtual clock (`now`), which the store's policies read. The mover
runs no thread: each call first runs the moves queued so far and one mover tick (one
round of its thread, `Mover.step`: a tier error is logged and counted there), so the
background work of a virtual gap is done before the next request of this instance (the real
mover keeps up within seconds; virtual gaps pass in milliseconds here).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import time
import traceback

from kvtier.store.base import block
from kvtier.store.base.errors import TierUnavailableError
from kvtier.store.base.keys import KEY_HEX
from kvtier.tiers.base import MISS


KEY_BYTES = KEY_HEX  # what `save` writes at the head of each payload: its key, in hex
SCRUB_WAIT_S = 60.0  # how long the end's read back waits for a tier to answer again


class InstanceDied(RuntimeError):
    """The instance's process is gone (killed, or crashed): nothing of the call came back."""


class InstanceKilled(InstanceDied):
    """`call(..., kill_after_s=)` killed the instance before it replied."""


class InstanceError(RuntimeError):
    """The instance is alive and the call raised there (its traceback is in its log)."""


class SimWorker:
    """The coordinator's handle on one instance process (spawned; calls are synchronous)."""

    def __init__(self, policy: dict, node_id: str, payload_bytes: int, log_path: str,
                 host: str | None = None, deadline_s: float | None = None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, policy, node_id, payload_bytes,
                                                    log_path, host, deadline_s),
                                name=f"kvtier-sim-{node_id}", daemon=True)
        self.log_path = log_path
        self.proc.start()
        child.close()

    def ready(self) -> None:
        self._reply()

    def call(self, *msg, kill_after_s: float | None = None):
        """Run `msg` in the instance; with `kill_after_s`, SIGKILL it if no reply came by then
        (InstanceDied: the call was cut in the middle)."""
        try:
            self.conn.send(msg)
        except OSError:  # the pipe broke: the process is gone
            self._died()
        if kill_after_s is not None and not self.conn.poll(kill_after_s):
            self.kill()
            raise InstanceKilled(f"simulated instance {self.proc.name} killed in the middle "
                               f"of {msg[0]!r}")
        return self._reply()

    def _reply(self):
        try:
            ok, value = self.conn.recv()
        except (EOFError, OSError):
            self._died()
        if not ok:
            raise InstanceError(f"simulated instance {self.proc.name}: {value} (log: "
                                f"{self.log_path})")
        return value

    def _died(self):
        self.proc.join(5)
        raise InstanceDied(f"simulated instance {self.proc.name} exited with code "
                           f"{self.proc.exitcode}; see {self.log_path}") from None

    def kill(self) -> None:
        """SIGKILL the instance's process (this handle's own child) and reap it."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(30)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close")
            except (RuntimeError, OSError):
                pass  # already gone; the join below reaps it
            self.proc.join(60)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self.conn.close()


class _Instance:
    def __init__(self, policy: dict, node_id: str, payload_bytes: int,
                 deadline_s: float | None = None):
        from kvtier.store.base.config import policy_from_dict
        from kvtier.store.tiered import TieredStore
        self.now = 0.0
        self.payload = payload_bytes
        self.slot = block.frame_size(payload_bytes, block.PAGE)
        self.store = TieredStore(policy_from_dict(policy, source=f"<sim {node_id}>"),
                                 node_id=node_id, mover=False, start_master=False,
                                 clock=lambda: self.now)
        self.arena = block.alloc_aligned(self.slot)
        self.deadline_s = deadline_s

    def _frames(self, n: int) -> list[memoryview]:
        if len(self.arena) < n * self.slot:
            self.arena = block.alloc_aligned(n * self.slot)
        return [self.arena[j * self.slot:(j + 1) * self.slot] for j in range(n)]

    def _catch_up(self, now: float) -> None:
        self.now = now
        self.store.mover.step()  # the thread's round: its tier errors are caught as there
        self.store.mover.step(tick=False)  # the moves the tick queued

    def request(self, keys, local, sid, now):
        from kvtier.store.tiered import SessionHint
        self._catch_up(now)
        hint = SessionHint(session_id=sid)
        found = self.store.lookup(keys, hint)
        todo = keys[local:found.hit_blocks]
        if not todo:
            return found.hit_blocks, [], 0.0, 0
        t = time.perf_counter()
        frames = self._frames(len(todo))
        if self.deadline_s is None:
            got = self.store.load(todo, frames)
        else:
            out = self.store.load_within(todo, frames, list(found.tiers[local:found.hit_blocks]),
                                         time.monotonic() + self.deadline_s)
            got = out.lengths
            if out.pending:  # a transfer left behind still writes into these frames
                self.arena = block.alloc_aligned(len(self.arena))
        secs = time.perf_counter() - t
        wrong = [j for j, (key, n, f) in enumerate(zip(todo, got, frames))
                 if n != MISS and not self._is_block_of(key, n, f)]
        good = next((j for j, n in enumerate(got) if n != self.payload), len(got))
        good = min([good, *wrong])
        return local + good, list(found.tiers[local:local + good]), secs, len(wrong)

    def _is_block_of(self, key: str, n: int, frame: memoryview) -> bool:
        """True if the `n`-byte payload loaded into `frame` is the block `save` wrote for
        `key` (its length, and the key in its first bytes)."""
        start = block.HEADER_SIZE
        return n == self.payload and bytes(frame[start:start + KEY_BYTES]) == key.encode()

    def save(self, keys, all_keys, sid, now):
        from kvtier.store.tiered import SessionHint
        self._catch_up(now)
        hint = SessionHint(session_id=sid)
        for lo in range(0, len(keys), 64):
            batch = keys[lo:lo + 64]
            frames = self._frames(len(batch))
            for key, f in zip(batch, frames):
                f[block.HEADER_SIZE:block.HEADER_SIZE + KEY_BYTES] = key.encode()
                block.seal(f, key, self.payload)
            self.store.save(batch, frames, hint)
        self.store.finish(all_keys, hint)
        return len(keys)

    def usage(self):
        self._catch_up(self.now)
        return {"tiers": self.store.usage(), "mover": self.store.mover_stats()}

    # ---- the soak's probes (tools.replay.soak.run) ------------------------------------------

    def counters(self):
        """Each tier's counters in this process, and the mover's (as `mover`)."""
        return {**{t.name: t.counters() for t in self.store.tiers},
                "mover": self.store.mover_stats()}

    def frames(self, tier: str, n: int, seed: int):
        """Up to `n` random stored frames of nvme tier `tier`: (key, data file, offset,
        frame bytes) each."""
        from kvtier.store.base.index_record import READY
        from kvtier.tiers.nvme.regions import DATA_FILE
        from kvtier.tiers.nvme.regions import unpack_loc
        t = self.store.by_name[tier]
        entries = list(self.store.index.scan(tier, states=(READY,)))
        live = t.contains([e.key for e in entries])  # in a region not reclaimed since
        entries = [e for e, ok in zip(entries, live) if ok]
        picked = random.Random(seed).sample(entries, min(n, len(entries)))
        return [(e.key, str(t.path / DATA_FILE),
                 unpack_loc(e.loc_a)[0] * t.region_bytes + e.loc_b, e.size) for e in picked]

    def scrub(self, tier: str, keys):
        """Read `keys` from tier `tier` alone, as any read does (a corrupt frame is
        quarantined; a sharedfs file another node removed drops this node's entry of it):
        {held: how many the tier had, corrupt: found now, wrong: served with wrong bytes}.
        A tier that is unavailable (a network filesystem whose link just came back) is
        waited for, up to `SCRUB_WAIT_S`."""
        t, keys = self.store.by_name[tier], list(keys)
        until = time.monotonic() + SCRUB_WAIT_S
        while True:
            try:
                held = sum(t.contains(keys))
                break
            except TierUnavailableError:
                if time.monotonic() > until:
                    raise
                time.sleep(0.5)
        before = t.counters()["corrupt"]
        frames = self._frames(len(keys))
        got = t.get(keys, frames)
        wrong = sum(1 for k, n, f in zip(keys, got, frames)
                    if n != MISS and not self._is_block_of(k, n, f))
        return {"held": held, "corrupt": t.counters()["corrupt"] - before, "wrong": wrong}


def _main(conn, policy: dict, node_id: str, payload_bytes: int, log_path: str,
          host: str | None = None, deadline_s: float | None = None) -> None:
    # Mooncake and tracebacks write to fds 1 and 2: into the instance's log, not the console
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # timestamps, so a fault's story can be placed beside the masters' logs
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if host is not None:  # before any thread or socket: a namespace is per thread
            from kvtier.tools.hosts.netns import enter
            enter(host)
        inst = _Instance(policy, node_id, payload_bytes, deadline_s)
    except Exception as e:  # reported to the coordinator in one line
        conn.send((False, f"cannot open the store: {type(e).__name__}: {e}"))
        return
    conn.send((True, None))
    try:
        while True:
            op, *args = conn.recv()
            if op == "close":
                inst.store.close()
                conn.send((True, None))
                return
            try:
                conn.send((True, getattr(inst, op)(*args)))
            except Exception as e:  # one line to the coordinator, the traceback to stderr
                traceback.print_exc()
                conn.send((False, f"{op}: {type(e).__name__}: {e}"))
    except (EOFError, KeyboardInterrupt):
        inst.store.close()
