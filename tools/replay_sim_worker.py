"""One simulated instance's store: a process with its own `TieredStore`, as a vLLM instance is.

Each simulated instance runs in its own process (`SimWorker`), with its own store client
lending its own pool segment, its own index and nvme dir, exactly as the connector inside a
vLLM process. Real blocks move: frames of `payload_bytes` (the tiny model's KV per chunk)
are sealed, saved, looked up, loaded and verified through the same `TieredStore` calls the
connector makes:
- `request(keys, local, hint, now)`: one lookup of the whole chain (the store attaches the
  request to its session by it), then a load of the hit beyond vLLM's local hit, `local`
  blocks (the connector's `get_num_new_matched_tokens` + worker load). A block that fails
  to load ends the hit there (vLLM recomputes from it). Returns (hit blocks, the tier of
  each loaded block, load seconds).
- `save(keys, all_keys, hint, now)`: write-through of the new chunks, then `finish` with the
  looked-up keys (the end of the turn).
Time is the coordinator's virtual clock (`now`), which the store's policies read. The mover
runs no thread: each call first runs the moves queued so far and one mover tick (one
round of its thread, `Mover.step`: a tier error is logged and counted there), so the
background work of a virtual gap is done before the next request of this instance (the real
mover keeps up within seconds; virtual gaps pass in milliseconds here).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

from kvtier.store import block
from kvtier.tiers import MISS


class SimWorker:
    """The coordinator's handle on one instance process (spawned; calls are synchronous)."""

    def __init__(self, policy: dict, node_id: str, payload_bytes: int, log_path: str):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, policy, node_id, payload_bytes,
                                                    log_path),
                                name=f"kvtier-sim-{node_id}", daemon=True)
        self.log_path = log_path
        self.proc.start()
        child.close()

    def ready(self) -> None:
        self._reply()

    def call(self, *msg):
        self.conn.send(msg)
        return self._reply()

    def _reply(self):
        try:
            ok, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"simulated instance {self.proc.name} exited with code "
                               f"{self.proc.exitcode}; see {self.log_path}") from None
        if not ok:
            raise RuntimeError(f"simulated instance {self.proc.name}: {value} (log: "
                               f"{self.log_path})")
        return value

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
    def __init__(self, policy: dict, node_id: str, payload_bytes: int):
        from kvtier.store.config import policy_from_dict
        from kvtier.store.tiered import TieredStore
        self.now = 0.0
        self.payload = payload_bytes
        self.slot = block.frame_size(payload_bytes, block.PAGE)
        self.store = TieredStore(policy_from_dict(policy, source=f"<sim {node_id}>"),
                                 node_id=node_id, mover=False, start_master=False,
                                 clock=lambda: self.now)
        self.arena = block.alloc_aligned(self.slot)

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
            return found.hit_blocks, [], 0.0
        t = time.perf_counter()
        got = self.store.load(todo, self._frames(len(todo)))
        secs = time.perf_counter() - t
        good = next((j for j, n in enumerate(got) if n != self.payload), len(got))
        return local + good, list(found.tiers[local:local + good]), secs

    def save(self, keys, all_keys, sid, now):
        from kvtier.store.tiered import SessionHint
        self._catch_up(now)
        hint = SessionHint(session_id=sid)
        for lo in range(0, len(keys), 64):
            batch = keys[lo:lo + 64]
            frames = self._frames(len(batch))
            for key, f in zip(batch, frames):
                f[block.HEADER_SIZE:block.HEADER_SIZE + 48] = key.encode()
                block.seal(f, key, self.payload)
            self.store.save(batch, frames, hint)
        self.store.finish(all_keys, hint)
        return len(keys)

    def usage(self):
        self._catch_up(self.now)
        return {"tiers": self.store.usage(), "mover": dict(self.store.mover.stats)}


def _main(conn, policy: dict, node_id: str, payload_bytes: int, log_path: str) -> None:
    # Mooncake and tracebacks write to fds 1 and 2: into the instance's log, not the console
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        inst = _Instance(policy, node_id, payload_bytes)
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
