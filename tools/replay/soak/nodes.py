"""The simulated instances of `kvtier replay --soak`: restartable, and counted.

`SoakNode` stands where `tools.replay.sim.SimRun` expects a `SimWorker` (`call(op, *args)`)
and adds what the soak needs:
- before each call, the soak's hook runs (`soak.before_call()`: the deadline, due faults);
  the arguments are rewritten for the current repetition of the plan (`soak.rewrite`: fresh
  session ids, virtual time carried on);
- a process that dies is restarted on the same node id, policy and directories (its
  `TieredStore` open recovers what it left), and the call is retried there: a call cut by a
  planned kill (`arm_kill`: the next `save` is SIGKILLed in its middle) is `retried`, one
  cut by an unplanned death or a hang is a failure (`crashed` / `hung`), and retried too;
- a call that raises inside a live instance is a failed request: the error is recorded and
  the simulation goes on with what a store that answered nothing would give (a miss, no save);
- every reply is handed to `soak.observe` (hits, tiers, wrong blocks).
Counters of a process are banked before a planned kill, so what it counted is not lost with
it (only what it counts during the killed call itself is).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter, deque

from kvtier.tools.replay.sim_worker import (InstanceDied, InstanceError, InstanceKilled,
                                            SimWorker)

HANG_S = 120.0          # a call without a reply this long is hung: kill, count, retry
START_TIMEOUT_S = 60.0  # keep trying to open a restarted instance this long
MAX_RETRIES = 3
KILL_TRIES = 10         # saves tried for a kill mid-call before killing between two calls


class SoakOver(Exception):
    """The soak's time is up (raised through `SimRun.run`)."""


class SoakNode:
    def __init__(self, node_id: str, policy: dict, payload_bytes: int, log_path: str, soak,
                 rng: random.Random, host: str | None = None, deadline_s: float | None = None):
        """`host`, `deadline_s`: as `SimWorker`'s (several hosts: the namespace it runs in)."""
        self.node, self.policy, self.log = node_id, policy, log_path
        self.host, self.deadline_s = host, deadline_s
        self.payload = payload_bytes
        self.soak, self.rng = soak, rng
        self.worker: SimWorker | None = None
        self.armed = 0          # > 0: the next saves are killed mid-call (attempts left)
        self.save_s: deque = deque(maxlen=32)  # seconds of its recent saves with blocks
        self.banked: Counter = Counter()  # tier counters of processes that are gone

    # ---- process life --------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the instance's process (`worker.ready()` waits for its store to open)."""
        self.worker = SimWorker(self.policy, self.node, self.payload, self.log, self.host,
                                self.deadline_s)

    def start(self) -> None:
        """Start the instance and wait until its store is open; a restart keeps trying
        while the open fails (the master may be down for a moment)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self.spawn()
            try:
                self.worker.ready()
                return
            except (InstanceError, InstanceDied) as e:
                self.worker.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"instance {self.node} cannot be restarted: {e}") from e
                time.sleep(0.5)

    def _restart(self) -> None:
        self.worker.kill()
        self.worker.close()
        self.start()

    def host_killed(self) -> None:
        """Every process of this node's host was killed (planned): count it and restart."""
        self.soak.killed(self.node, "host killed", "")
        self.armed = 0
        self._restart()

    def arm_kill(self) -> None:
        self.armed = KILL_TRIES

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # ---- calls ---------------------------------------------------------------------------

    def call(self, op: str, *args):
        self.soak.before_call()
        args = self.soak.rewrite(op, args)
        for attempt in range(MAX_RETRIES + 1):
            planned = op == "save" and self.armed > 0 and bool(args[0])  # blocks to write
            if planned:
                self._bank()  # before the kill: what this process counted so far
            t = time.monotonic()
            try:
                value = self.worker.call(op, *args, kill_after_s=self._kill_after(planned))
            except InstanceKilled as e:
                self._died("killed mid-call" if planned else "hung", str(e))
                continue
            except InstanceDied as e:
                self._died("crashed", str(e))
                continue
            except InstanceError as e:
                self.soak.failed(self.node, op, str(e))
                return _nothing(op, args)
            if op == "save" and args[0]:
                self.save_s.append(time.monotonic() - t)
            if planned:  # the reply beat the kill: try the next save, sooner
                self.armed -= 1
                if not self.armed:
                    self._kill_between_calls()
            self.soak.observe(self.node, op, args, value)
            return value
        self.soak.failed(self.node, op, f"gave up after {MAX_RETRIES} retries")
        return _nothing(op, args)

    def _kill_after(self, planned: bool) -> float:
        """A planned kill lands at a uniform point of this node's median save (catching up
        the mover, writing); each try the reply won halves the span."""
        if not planned:
            return HANG_S
        span = statistics.median(self.save_s) if self.save_s else 0.01
        return self.rng.uniform(0.0, span * 0.5 ** (KILL_TRIES - self.armed))

    def _died(self, how: str, why: str) -> None:
        self.soak.killed(self.node, how, why)
        self.armed = 0
        self._restart()

    def _kill_between_calls(self) -> None:
        """Every mid-call try lost the race to the reply: kill now, between calls, and
        restart (nothing was in flight: nothing to retry)."""
        self._bank()
        self.worker.kill()
        self.soak.killed(self.node, "killed between calls", "")
        self._restart()

    # ---- probes (no soak hooks; a dead instance is restarted and the probe gives up) ----

    def probe(self, op: str, *args):
        try:
            return self.worker.call(op, *args, kill_after_s=HANG_S)
        except InstanceError as e:
            self.soak.failed(self.node, op, str(e))
        except InstanceDied as e:
            self._died("crashed", str(e))
        return None

    def _bank(self) -> None:
        got = self.probe("counters")
        for tier, c in (got or {}).items():
            for k, v in c.items():
                self.banked[(tier, k)] += v

    def counters(self) -> dict[str, dict[str, int]]:
        """Every process's tier counters of this node, summed (the live one included)."""
        total = Counter(self.banked)
        for tier, c in (self.probe("counters") or {}).items():
            for k, v in c.items():
                total[(tier, k)] += v
        out: dict[str, dict[str, int]] = {}
        for (tier, k), v in total.items():
            out.setdefault(tier, {})[k] = v
        return out


def _nothing(op: str, args: tuple):
    """What a store that answered nothing gives: vLLM's local hit only, nothing saved."""
    if op == "request":
        return args[1], [], 0.0, 0
    return 0
