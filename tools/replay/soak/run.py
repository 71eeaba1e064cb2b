"""`kvtier replay --engine sim --soak MINUTES`: the simulated replay under faults, for a while.

Only the kvtier configuration runs (no baselines), on N simulated instances
(`tools.replay.sim`) whose nvme dirs and shared dir live on a tmpfs mounted for the soak
(`tools.replay.soak.faults.SoakDisk`; plain dirs when it cannot be mounted). The workload plan is
replayed again and again, each repetition with fresh keys (the plan's seed + repetition),
fresh session ids and virtual time carried on, until `seconds` of wall time have passed.
Every `fault_every_s` seconds of wall time the injector (`tools.replay.soak.injector`) adds the
next fault of the rotation: an instance SIGKILLed mid-save and restarted, the master
killed and restarted, the disk filled to ENOSPC for a while, stored frames corrupted.

Verified, and required by `ok`:
- zero wrong blocks served: every loaded frame is checked against its key
  (`tools.replay.sim_worker`); a frame that fails is a wrong block, not a miss;
- zero failed requests: a store call that raises, or an instance that dies or hangs
  unplanned, is a failure; a call cut by a planned kill is retried on the restarted
  instance and counted as retried;
- the pool serves hits again within `RECOVERY_BOUND_S` of every master restart;
- at the end, the corrupted keys still stored are read back through their tier (so
  corruption nobody read yet is quarantined, never served), everything is closed and
  `inspect check` (`store.check.node.check_node`) runs on every node, the shared dir included:
  zero problems.
`run_soak(spec, ui) -> dict` is the `--json` report; `ui` has `say(msg)` and
`progress(elapsed_s)`.
"""

from __future__ import annotations

import os
import platform
import random
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvtier.store.base import block
from kvtier.store.base.config import MasterConfig, policy_from_dict
from kvtier.store.base.keys import Namespace
from kvtier.store.check.node import check_node
from kvtier.tiers.mooncake.master import EmbeddedMaster, free_port
from kvtier.tools.jsonout import plain
from kvtier.tools.threads import in_threads
from kvtier.tools.replay.cluster import Config, ReplayError, Sizing, node_policy
from kvtier.tools.replay.experiment import (EngineSpec, build_plan, bytes_per_token,
                                            kv_tokens_for)
from kvtier.tools.replay.prefill_model import Calibration
from kvtier.tools.replay.router import make_router
from kvtier.tools.replay.runners import TIER_KINDS
from kvtier.tools.replay.sim import SimRun
from kvtier.tools.replay.soak.faults import SoakDisk
from kvtier.tools.replay.soak.injector import FAULTS, HOST_FAULTS, Injector
from kvtier.tools.replay.soak.nodes import SoakNode, SoakOver
from kvtier.tools.replay.soak.report import report

RECOVERY_BOUND_S = 30.0
HOST_LOAD_DEADLINE_S = 2.0  # on several hosts a load gives up after this (a link cut)
REP_GAP_S = 600.0       # virtual seconds between two repetitions: every session idles
DISK_SLACK = 32 << 20   # tmpfs room beyond the tiers' capacities (temps, quarantine)


@dataclass(frozen=True)
class SoakSpec:
    engine: EngineSpec
    seconds: float
    fault_every_s: float = 60.0
    faults: tuple[str, ...] = FAULTS
    ha: bool = False  # with hosts: HA masters (leader, standby) and etcd on hosts of their own

    def check(self) -> None:
        self.engine.check()
        if self.engine.engine != "sim":
            raise ReplayError("--soak runs the simulated engines only: use --engine sim")
        if self.seconds <= 0 or self.fault_every_s <= 0:
            raise ReplayError("--soak and --fault-every must be positive")
        if len(self.engine.instances) != 1:
            raise ReplayError("--soak runs one instance count; give one --instances")
        known = FAULTS + HOST_FAULTS
        bad = [f for f in self.faults if f not in known]
        if bad or not self.faults:
            raise ReplayError(f"--faults: expected some of {', '.join(known)}")
        if self.engine.hosts < 2 and set(self.faults) & set(HOST_FAULTS):
            raise ReplayError(f"--faults {', '.join(HOST_FAULTS)} need several hosts: add "
                              "--hosts 2 or more")
        if ("leader-kill" in self.faults) != self.ha:
            raise ReplayError("--faults leader-kill goes with --ha (HA masters), and --ha "
                              "with it" if self.ha else "--faults leader-kill needs --ha")
        if self.ha and "master-restart" in self.faults:
            raise ReplayError("--ha has no single master to restart: drop master-restart "
                              "from --faults (leader-kill kills the leader)")


def soak_policy(root: Path, disk: Path, node: str, address: str, es: EngineSpec,
                sizing: Sizing, etcd: str | None = None, shared: Path | None = None) -> dict:
    """The replay's node policy, with the nvme and shared dirs on the soak's disk (`etcd`:
    the HA masters' etcd; `shared`: the shared dir on its host's network filesystem
    instead)."""
    return node_policy(root, node, address, Config("kvtier", es.dram[0], "kvtier"), sizing,
                       es.chunk_tokens, es.eviction, es.admission, tiers_root=disk,
                       etcd=etcd, shared=shared)


def run_soak(spec: SoakSpec, ui) -> dict:
    spec.check()
    es = spec.engine
    n = es.instances[0]
    plan = build_plan(es, es.sessions)
    payload = es.chunk_tokens * bytes_per_token(es.dtype)
    sizing = Sizing(payload, plan.unique_blocks * block.frame_size(payload, block.PAGE), n)
    root = es.out / "work" / "soak"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    hosts = None
    if es.hosts > 1:  # instance k on host k % hosts, the master(s) and etcd on more
        from kvtier.tools.hosts.cluster import HostCluster
        hosts = HostCluster(es.hosts + (3 if spec.ha else 1), root / "hosts")
        hosts.hosts.on_signals()
        if es.shared_fs == "glusterfs":
            ui.say(f"mounting a GlusterFS volume with a brick on each of {hosts.k} hosts")
            hosts.mount_glusterfs()
        if spec.ha:
            ui.say("starting etcd and two HA masters")
            hosts.start_ha(es.hosts, es.hosts + 1, es.hosts + 2)
        else:
            hosts.master_host = es.hosts
        address = hosts.master_address
    else:
        address = f"127.0.0.1:{free_port()}"
    etcd = hosts.etcd if hosts is not None else None
    pols = {f"n{k}": soak_policy(root, root / "disk", f"n{k}", address, es, sizing, etcd,
                                 hosts.shared_of(k % es.hosts) if hosts else None)
            for k in range(n)}
    size = DISK_SLACK + sum(t["capacity"] for p in pols.values() for t in p["tiers"]
                            if t["kind"] != "mooncake")
    soak = Soak(spec, ui, root, pols, sizing, kv_tokens_for(es, plan, n)[1], hosts)
    t = time.time()
    try:
        with SoakDisk(root / "disk", size) as disk:
            if disk.skipped:
                ui.say(f"disk-full fault skipped: {disk.skipped}")
            result = soak.run(disk, address, plan)
    finally:
        if hosts is not None:
            hosts.close()
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
           "spec": {**plain(asdict(es)), "soak_s": spec.seconds,
                    "fault_every_s": spec.fault_every_s, "faults": list(spec.faults)},
           "instances": n, "plan_requests": len(plan), "disk_bytes": size,
           "tmpfs": disk.skipped is None, **result}
    out["wall_s"] = round(time.time() - t, 1)
    return out


class Soak:
    """The soak's state, the hooks its nodes call, and its run."""

    def __init__(self, spec: SoakSpec, ui, root: Path, pols: dict, sizing: Sizing,
                 kv_tok: int, hosts=None):
        self.spec, self.ui, self.root, self.pols = spec, ui, root, pols
        self.hosts = hosts  # a HostCluster, with --hosts
        self.sizing, self.kv_tok = sizing, kv_tok
        self.rng = random.Random(spec.engine.seed)
        self.t0 = time.monotonic()
        self.rep, self.offset = 0, 0.0
        self.kills: Counter = Counter()
        self.intervals: dict[int, Counter] = {}
        self.failures: list[str] = []
        self.injector: Injector | None = None
        self._shown = 0.0

    def _shared_root(self, disk) -> Path:
        """Where the shared tier's files are seen from here: the soak's disk, or a host's
        mount of the network filesystem (every mount shows the same files)."""
        shared = self.hosts.shared_of(0) if self.hosts is not None else None
        return shared if shared is not None else disk.where / "shared"

    # ---- hooks of SoakNode ---------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def before_call(self) -> None:
        now = self.now()
        if now >= self.spec.seconds:
            raise SoakOver()
        self.injector.tick(now)
        if now - self._shown >= 0.5:
            self._shown = now
            self.ui.progress(now)

    def rewrite(self, op: str, args: tuple) -> tuple:
        """(..., session id, now): this repetition's session ids, virtual time carried on."""
        *rest, sid, t = args
        return (*rest, None if sid is None else f"r{self.rep}-{sid}", t + self.offset)

    def _iv(self, now: float) -> Counter:
        return self.intervals.setdefault(self.injector.interval(now), Counter())

    def observe(self, node: str, op: str, args: tuple, value) -> None:
        now = self.now()
        iv = self._iv(now)
        if op == "save":
            iv["completed"] += 1
        elif op == "request":
            hit, tiers, _, wrong = value
            iv.update(requests=1, blocks=len(args[0]), local=args[1], hit=hit, wrong=wrong)
            iv.update("from_" + t for t in tiers)
            if "dram" in tiers:
                self.injector.on_pool_hit(now)

    def failed(self, node: str, op: str, why: str) -> None:
        self._iv(self.now())["failed"] += 1
        if len(self.failures) < 200:
            self.failures.append(f"{node} {op}: {why}")
        self.ui.say(f"FAILED {node} {op}: {why}")

    def killed(self, node: str, how: str, why: str) -> None:
        self.kills[how] += 1
        if how != "killed between calls":
            self._iv(self.now())["retried"] += 1
        if how in ("crashed", "hung"):
            self.failed(node, how, why)

    # ---- the run -------------------------------------------------------------------------

    def run(self, disk: SoakDisk, address: str, plan) -> dict:
        es = self.spec.engine
        node_hosts: dict[str, int] = {}
        ha = None
        if self.hosts is not None:
            from kvtier.tools.hosts.cluster import HostMaster
            master = HostMaster(self.hosts, es.hosts)
            if self.spec.ha:
                ha = [es.hosts, es.hosts + 1]  # started by run_soak
            else:
                master.start()
            node_hosts = {node: k % es.hosts for k, node in enumerate(self.pols)}
        else:
            master = EmbeddedMaster(MasterConfig(address=address),
                                    log_path=self.root / "master.log").start()
        names = self.hosts.hosts.names if self.hosts is not None else None
        nodes = [SoakNode(node, pol, self.sizing.block_bytes,
                          str(self.root / f"instance-{node}.log"), self, self.rng,
                          names[node_hosts[node]] if names else None,
                          HOST_LOAD_DEADLINE_S if names else None)
                 for node, pol in self.pols.items()]
        try:
            self.ui.say(f"starting {len(nodes)} simulated instances")
            for node in nodes:
                (disk.where / node.node).mkdir(exist_ok=True)  # the tiers want a parent
                node.spawn()
            for node in nodes:
                node.worker.ready()
            self.injector = Injector(self.spec.fault_every_s, master, nodes, disk,
                                     self._shared_root(disk), self.rng, self.ui.say,
                                     self.spec.faults, self.hosts, node_hosts, ha)
            self.t0 = time.monotonic()  # the soak's clock starts with the cluster up
            reps = self._replay(nodes, plan, Calibration.load(es.calibration).model)
            self.injector.finish(self.now())
            end = self._read_back(nodes)
        finally:
            try:
                if self.injector is not None:
                    self.injector.finish(self.now())  # the master back: clients close fast
            finally:
                # at once: a client of HA masters takes ~30 s to close (README)
                in_threads([node.close for node in nodes])
                master.stop()
        checks = {node: check_node(policy_from_dict(pol, source=f"<soak {node}>"),
                                   node_id=node) for node, pol in self.pols.items()}
        return report(self, reps, end, checks, RECOVERY_BOUND_S)

    def _replay(self, nodes: list[SoakNode], plan, model) -> int:
        """Repeat the plan (fresh keys and sessions each time) until the time is up;
        returns the repetitions begun."""
        es = self.spec.engine
        ns = Namespace(model="tiny-llama-sim", dtype=es.dtype, block_size=32,
                       chunk_tokens=es.chunk_tokens)
        while True:
            sim = SimRun(plan, nodes, make_router(es.router, len(nodes)), model, TIER_KINDS,
                         self.kv_tok // plan.block_tokens, ns.fingerprint(),
                         self.sizing.block_bytes, es.speed)
            try:
                records = sim.run()
            except SoakOver:
                return self.rep + 1
            self.offset += max(r["end"] for r in records if r) + REP_GAP_S
            self.rep += 1
            plan = build_plan(replace(es, seed=es.seed + self.rep), es.sessions)

    def _read_back(self, nodes: list[SoakNode]) -> dict:
        """Read every corrupted key from its own tier (quarantining what nobody read yet),
        then every node's tier counters. Shared keys are read through every node: the first
        read of a corrupt file quarantines it and drops that node's entry; the others find
        it gone and drop theirs, as their next read of the key would (until then `inspect
        check` reports their entry `missing`)."""
        scrub = {"shared": Counter(), "nvme": Counter()}
        todo = [(node, "shared", self.injector.corrupted["shared"]) for node in nodes]
        todo += [(node, "nvme", self.injector.corrupted.get(node.node)) for node in nodes]
        for node, tier, keys in todo:
            if keys:
                got = Counter(node.probe("scrub", tier, sorted(keys)) or {})
                if tier == "shared" and node is not nodes[0]:
                    got.pop("held", None)  # the same files: count them once
                scrub[tier].update(got)
        return {"scrub": {t: dict(c) for t, c in scrub.items()},
                "counters": {n.node: n.counters() for n in nodes}}
