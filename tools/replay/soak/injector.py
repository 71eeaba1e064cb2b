"""The fault injector of `kvtier replay --soak`: the next fault of a rotation every
`every_s` seconds of wall time, each undone after a while.

Faults (`FAULTS`, in this order):
- `process-kill`: the next `save` of one instance (in turn) is SIGKILLed in its middle, the
  instance restarted on the same node (`tools.replay.soak.nodes`);
- `master-restart`: `mooncake_master` SIGKILLed, started again on the same address after
  `down_s`; the seconds from its return to the first block served from the pool again
  are its recovery time (`on_pool_hit`);
- `disk-full`: a balloon file fills the tmpfs under the nvme and shared dirs to ENOSPC,
  removed after `hold_s` (skipped, and counted so, when the soak has no tmpfs);
- `corrupt-file`: bits flipped in, or truncation of, a random sharedfs block file, and bits
  flipped in a random stored frame of one instance's nvme data file;
- on several hosts (`hosts`: a `tools.hosts.cluster.HostCluster`), `link-cut`: one
  instance host (in turn) is taken off the network for `cut_s` and put back; `host-kill`:
  every process of one instance host is SIGKILLed (a lender gone while others read its
  blocks) and its instances are started again; with HA masters (`ha`: [leader host,
  standby host]), `leader-kill`: the leading master SIGKILLed, the standby takes over, the
  old one joins again as standby after `cut_s`. The seconds from each one's end (link back,
  instances up; for a leader kill, the kill) to the next block served from the pool are its
  recovery time, as for the master. For a leader kill the seconds until etcd names the new
  leader (`elected_s`) are recorded too: the rest of its recovery is the new leader's
  warm-up and the clients' switch to it.
Everything runs on the soak's own thread between two store calls (`tick`), so a master it
starts lives as long as the soak (a master dies with the thread that started it). The
corrupted keys are kept (`corrupted`) so that the end of the soak can read them back.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from pathlib import Path

from kvtier.store.base.errors import MasterError
from kvtier.tools.replay.soak.faults import Balloon, corrupt_block_file, corrupt_frame

FAULTS = ("process-kill", "master-restart", "disk-full", "corrupt-file")
HOST_FAULTS = ("link-cut", "host-kill", "leader-kill")  # with --hosts (leader-kill: --ha)
MASTER_DOWN_S = 3.0
LINK_CUT_S = 20.0
DISK_FULL_HOLD_S = 10.0
MASTER_START_TRIES = 5


class Injector:
    def __init__(self, every_s: float, master, nodes: list, disk, shared_root: Path,
                 rng: random.Random, say, faults: tuple[str, ...] = FAULTS, hosts=None,
                 node_hosts: dict[str, int] | None = None, ha: list[int] | None = None):
        self.every_s, self.master, self.nodes, self.disk = every_s, master, nodes, disk
        self.hosts, self.node_hosts = hosts, node_hosts or {}
        self.instance_hosts = sorted(set(self.node_hosts.values()))
        self.ha = list(ha or [])  # [the leading master's host, the standby's]
        self.cut_s = min(LINK_CUT_S, every_s / 2)
        self.since: dict[str, float] = {}  # fault kind -> when it ended, until a pool hit
        self.recovery_by_fault: dict[str, list[float]] = {}
        self.unrecovered_by_fault: dict[str, list[float]] = {}  # no pool hit before the next
        self.shared_root, self.rng, self.say, self.faults = shared_root, rng, say, faults
        self.down_s = min(MASTER_DOWN_S, every_s / 3)
        self.hold_s = min(DISK_FULL_HOLD_S, every_s / 2)
        self.balloon = Balloon(disk.where)
        self.next_at, self.k = every_s, 0
        self.pending: list[tuple[float, object]] = []   # (due, undo(now))
        self.counts = {f: {"injected": 0, "skipped": 0} for f in faults}
        self.log: list[dict] = []                       # every fault, when and what
        self.corrupted: dict[str, set[str]] = {"shared": set()}
        self.up_at: float | None = None                 # the master's last return
        self.recovery_s: list[float] = []
        self.unrecovered_s: list[float] = []            # waited this long, then no more soak
        self.elected_s: list[float | None] = []         # per leader kill (None: none within)

    # ---- the clock -----------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Undo what is due, then inject the next fault if its time has come."""
        for item in [p for p in self.pending if p[0] <= now]:
            self.pending.remove(item)
            item[1](now)
        if now >= self.next_at:
            kind = self.faults[self.k % len(self.faults)]
            self.next_at += self.every_s
            self.k += 1
            getattr(self, "_" + kind.replace("-", "_"))(now)

    def interval(self, now: float) -> int:
        return int(now // self.every_s)

    def finish(self, now: float) -> None:
        """Undo everything still pending (the master back, the balloon gone)."""
        for _, undo in sorted(self.pending, key=lambda p: p[0]):
            undo(now)
        self.pending.clear()
        for kind, since in self.since.items():
            self.unrecovered_by_fault.setdefault(kind, []).append(round(now - since, 2))
        self.since.clear()
        if self.up_at is not None:
            self.unrecovered_s.append(round(now - self.up_at, 2))
            self.up_at = None

    def _record(self, now: float, kind: str, detail: str, skipped: bool = False) -> None:
        self.counts[kind]["skipped" if skipped else "injected"] += 1
        self.log.append({"t_s": round(now, 1), "interval": self.interval(now), "kind": kind,
                         "skipped": skipped, "detail": detail})
        self.say(f"[{now:6.1f} s] {kind}{' skipped' if skipped else ''}: {detail}")

    # ---- the faults ----------------------------------------------------------------------

    def _process_kill(self, now: float) -> None:
        node = self.nodes[self.counts["process-kill"]["injected"] % len(self.nodes)]
        node.arm_kill()
        self._record(now, "process-kill", f"instance {node.node}: its next save is killed "
                     "mid-call, then restarted")

    def _master_restart(self, now: float) -> None:
        if self.up_at is not None:  # the last restart never served a pool hit
            self.unrecovered_s.append(round(now - self.up_at, 2))
            self.up_at = None
        self.master.kill()
        self.master.stop()  # closes its log
        self.pending.append((now + self.down_s, self._master_up))
        self._record(now, "master-restart", f"mooncake_master SIGKILLed; back on "
                     f"{self.master.address} in {self.down_s:.1f} s")

    def _master_up(self, now: float) -> None:
        t = time.monotonic()
        for attempt in range(MASTER_START_TRIES):  # its port may take a moment to free
            try:
                self.master.start()
                break
            except MasterError as e:
                if attempt + 1 == MASTER_START_TRIES:
                    raise
                self.say(f"master restart failed ({e}); trying again")
                time.sleep(1.0)
        now += time.monotonic() - t  # recovery counts from the master answering
        self.up_at = now
        self.say(f"[{now:6.1f} s] master back on {self.master.address}")

    def on_pool_hit(self, now: float) -> None:
        """A request loaded blocks from the pool: it serves again since the last restart."""
        for kind, since in list(self.since.items()):
            self.recovery_by_fault.setdefault(kind, []).append(round(now - since, 2))
            del self.since[kind]
            elected = (f" (etcd named the new leader after {self.elected_s[-1]:.1f} s)"
                       if kind == "leader-kill" and self.elected_s and self.elected_s[-1]
                       else "")
            self.say(f"[{now:6.1f} s] pool hits again {now - since:.1f} s after the "
                     f"{kind}{elected}")
        if self.up_at is not None:
            self.recovery_s.append(round(now - self.up_at, 2))
            self.say(f"[{now:6.1f} s] pool hits again {now - self.up_at:.1f} s after the "
                     "master came back")
            self.up_at = None

    def _recovering(self, kind: str, since: float, now: float) -> None:
        """`kind` ended at `since`: its recovery lasts until the next pool hit (one still
        waiting is recorded as unrecovered, for as long as it waited)."""
        if kind in self.since:
            self.unrecovered_by_fault.setdefault(kind, []).append(
                round(now - self.since[kind], 2))
        self.since[kind] = since

    def _next_host(self, kind: str) -> int | None:
        if not self.instance_hosts:
            return None
        done = self.counts[kind]["injected"]
        return self.instance_hosts[done % len(self.instance_hosts)]

    def _link_cut(self, now: float) -> None:
        i = self._next_host("link-cut")
        if i is None:
            self._record(now, "link-cut", "one host only (--hosts 1)", skipped=True)
            return
        self.hosts.hosts.cut(i)
        self.pending.append((now + self.cut_s, lambda t, i=i: self._link_back(t, i)))
        self._record(now, "link-cut", f"host {i} off the network for {self.cut_s:.0f} s")

    def _link_back(self, now: float, i: int) -> None:
        self.hosts.hosts.restore(i)
        self._recovering("link-cut", now, now)
        self.say(f"[{now:6.1f} s] host {i} back on the network")

    def _host_kill(self, now: float) -> None:
        i = self._next_host("host-kill")
        if i is None:
            self._record(now, "host-kill", "one host only (--hosts 1)", skipped=True)
            return
        t = time.monotonic()
        nodes = [n for n in self.nodes if self.node_hosts.get(n.node) == i]
        for node in nodes:
            node._bank()  # what its processes counted, before they go
        killed = self.hosts.hosts.kill(i)
        self.hosts.host_restarted(i)
        self._record(now, "host-kill", f"host {i}: {killed} processes SIGKILLed, its "
                     f"instances {', '.join(n.node for n in nodes)} started again")
        for node in nodes:
            node.host_killed()
        self._recovering("host-kill", now + time.monotonic() - t, now)  # from its instances up

    def _leader_kill(self, now: float) -> None:
        if len(self.ha) < 2:
            self._record(now, "leader-kill", "no HA masters (--ha)", skipped=True)
            return
        old, new = self.ha
        self.hosts.kill_ha_master(old)
        self.ha = [new, old]
        self.elected_s.append(None)
        threading.Thread(target=self._await_election, daemon=True, name="soak-election",
                         args=(len(self.elected_s) - 1, self.hosts.ha_address(old),
                               time.monotonic())).start()
        self._recovering("leader-kill", now, now)
        self.pending.append((now + self.cut_s, lambda t, i=old: self._standby_up(t, i)))
        self._record(now, "leader-kill", f"the leading master on host {old} SIGKILLed; the "
                     f"standby on host {new} takes over")

    def _await_election(self, slot: int, killed: str, t0: float) -> None:
        """Record when etcd names a leader other than the `killed` one (within `every_s`;
        each ask takes a process in etcd's host, ~0.1-0.2 s)."""
        while time.monotonic() - t0 < self.every_s:
            try:
                leader = self.hosts.leader()
            except (OSError, subprocess.SubprocessError):
                leader = None  # a slow or failed ask: ask again
            if leader is not None and leader != killed:
                self.elected_s[slot] = round(time.monotonic() - t0, 2)
                return
            time.sleep(0.05)

    def _standby_up(self, now: float, i: int) -> None:
        self.hosts.start_ha_master(i)
        self.say(f"[{now:6.1f} s] the master on host {i} is back, as a standby")

    def _disk_full(self, now: float) -> None:
        if self.disk.skipped:
            self._record(now, "disk-full", self.disk.skipped, skipped=True)
            return
        took = self.balloon.fill()
        self.pending.append((now + self.hold_s, self._disk_free))
        self._record(now, "disk-full", f"a balloon of {took / 2**20:.0f} MiB fills the "
                     f"tmpfs to ENOSPC for {self.hold_s:.0f} s")

    def _disk_free(self, now: float) -> None:
        self.balloon.pop()
        self.say(f"[{now:6.1f} s] balloon removed")

    def _corrupt_file(self, now: float) -> None:
        key, what = corrupt_block_file(self.shared_root, self.rng)
        if key is not None:
            self.corrupted["shared"].add(key)
        done = [f"shared: {what}"]
        node = self.rng.choice(self.nodes)
        frames = node.probe("frames", "nvme", 1, self.rng.randrange(1 << 30)) or []
        for key, path, offset, size in frames:
            done.append(f"{node.node} nvme: {corrupt_frame(path, offset, size, self.rng)}")
            self.corrupted.setdefault(node.node, set()).add(key)
        if not frames:
            done.append(f"{node.node} nvme: no stored frame to corrupt")
        self._record(now, "corrupt-file", "; ".join(done))
