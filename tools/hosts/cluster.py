"""A kvtier cluster over `Hosts`: a master on one host, a home per host, one shared dir.

`HostCluster(k, root)` makes k hosts (`tools.hosts.netns`), a home directory per host under
`root` (its index, nvme dir and run dir: nothing of one host's node state is seen by
another) and `root/shared`, the one directory every host uses as its sharedfs tier (the
shared filesystem; `mount_glusterfs` gives each host its own mount of a GlusterFS volume
instead). `start_master(i)` runs `kvtier master` on host i, bound to that host's
address. `policy(i)` is host i's policy: the embedded defaults with only the master's
address given (so `local_hostname` is unset: cross-host by default) and tiers sized for a
test. `start_ha(leader, standby, etcd)` runs Mooncake's HA masters instead: etcd on one
host, a leader and a standby on two others, and every policy names etcd. Processes of a
host start with `hosts.popen(i, ...)`; `HostNode` runs a kvtier node there and calls it op
by op.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

import yaml

from kvtier.store.base.errors import MasterError
from kvtier.tools.hosts.netns import Hosts, HostsError

MASTER_PORT = 50051
ETCD_PORT = 2379
START_S = 30.0
TIERS = ("dram", "nvme", "shared")


def kvtier_argv(*args: str) -> list[str]:
    """The kvtier CLI of this interpreter, as a command line."""
    return [sys.executable, "-c", "from kvtier.tools.cli import main; main()", *args]


class HostCluster:
    """k hosts with a master, homes and a shared dir; a context manager."""

    def __init__(self, k: int, root: Path, dram: str = "64MiB"):
        """Every host's sharedfs tier uses `root/shared` until `use_shared` gives each host
        its own mount of a network filesystem."""
        self.root = Path(root)
        self.dram = dram
        self.hosts = Hosts(k)
        self.shared = self.root / "shared"
        self.shared.mkdir(parents=True, exist_ok=True)
        self.shared_dirs: list[Path] | None = None  # with `use_shared`: host i's at [i]
        self.volume = None  # with `mount_glusterfs`: the GlusterVolume across the hosts
        self.master_host: int | None = None
        self.master: subprocess.Popen | None = None
        self.etcd: str | None = None  # with `start_ha`: the etcd endpoint every policy names
        self.etcd_host = 0            # and the host it runs on
        self.masters: dict[int, subprocess.Popen] = {}  # HA masters by host

    @classmethod
    def for_engines(cls, engine_hosts: int, root: Path, shared_fs: str = "dir"
                    ) -> "HostCluster":
        """`engine_hosts` hosts for a replay's engines and one more running the master,
        torn down on SIGTERM/SIGINT too (what `replay --hosts` makes); `shared_fs`
        `glusterfs`: the shared filesystem on GlusterFS (`mount_glusterfs`)."""
        cluster = cls(engine_hosts + 1, root)
        try:
            cluster.hosts.on_signals()
            if shared_fs == "glusterfs":
                cluster.mount_glusterfs()
            cluster.start_master(engine_hosts)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def shared_of(self, i: int) -> Path | None:
        """Host i's own mount of the network filesystem (`use_shared`, `mount_glusterfs`),
        else None (every host uses the one directory)."""
        return self.shared_dirs[i] if self.shared_dirs else None

    def use_shared(self, dirs: list[Path]) -> None:
        """Host i's sharedfs tier uses `dirs[i]`: each host's own mount of one network
        filesystem (`GlusterVolume(root, cluster.hosts).mounts`, a subdirectory of each)."""
        if len(dirs) != self.k:
            raise HostsError(f"use_shared wants a directory per host ({self.k}), got {len(dirs)}")
        self.shared_dirs = [Path(d) for d in dirs]
        for d in self.shared_dirs:
            d.mkdir(parents=True, exist_ok=True)

    def mount_glusterfs(self) -> None:
        """Put the shared filesystem on GlusterFS, as deployed: a brick on every host and
        each host's own mount (`tools.hosts.glusterfs`); its sharedfs tier uses
        `shared_dirs[i]` there. Raises `HostsError` (one line) where GlusterFS cannot run."""
        from kvtier.tools.hosts.glusterfs import GlusterVolume
        self.volume = GlusterVolume(self.root / "glusterfs", self.hosts)
        self.use_shared([m / "shared" for m in self.volume.mounts])

    def host_restarted(self, i: int) -> None:
        """Every process of host i was killed: bring back what the cluster runs there
        besides kvtier (its GlusterFS daemon, brick and mount)."""
        if self.volume is not None:
            self.volume.restart(i)

    @property
    def k(self) -> int:
        return self.hosts.k

    @property
    def master_address(self) -> str:
        if self.master_host is None:
            raise HostsError("no master started: call start_master first")
        return f"{self.hosts.addresses[self.master_host]}:{MASTER_PORT}"

    def home(self, i: int) -> Path:
        path = self.root / f"host{i}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def policy(self, i: int, tiers: tuple[str, ...] = TIERS, **dram: object) -> dict:
        """Host i's policy: defaults, the master's address, `tiers` of the default three;
        `dram` adds settings to the mooncake tier (segment_dir, ...)."""
        home = self.home(i)
        every = {
            "dram": {"name": "dram", "kind": "mooncake", "capacity": self.dram,
                     "buffer": "16MiB", "staging": "16MiB", **dram},
            "nvme": {"name": "nvme", "kind": "nvme", "path": str(home / "nvme"),
                     "capacity": "256MiB", "region_size": "4MiB"},
            "shared": {"name": "shared", "kind": "sharedfs",
                       "path": str(self.shared_of(i) or self.shared),
                       "capacity": "1GiB"},
        }
        return {"chunk_tokens": 256,
                "index": {"path": str(home / "index"), "map_size": "64MiB"},
                "master": {"address": self.master_address if self.master_host is not None
                           else f"{self.hosts.addresses[i]}:{MASTER_PORT}",
                           "embedded": False, "run_dir": str(home / "run"),
                           **({"etcd": [self.etcd]} if self.etcd else {})},
                "tiers": [every[t] for t in tiers]}

    def write_policy(self, i: int, name: str = "policy.yaml", **kw) -> Path:
        path = self.home(i) / name
        path.write_text(yaml.safe_dump(self.policy(i, **kw)))
        return path

    def start_master(self, i: int = 0) -> str:
        """Run `kvtier master` on host i; returns its address once it answers there."""
        self.master_host = i
        policy = self.write_policy(i, "master.yaml")
        log = open(self.home(i) / "master.log", "ab")
        self.master = self.hosts.popen(i, kvtier_argv("master", "-p", str(policy), "--log",
                                                      str(self.master_log(i))),
                                       stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self._wait(i, self.master_address, "kvtier master", self.master)
        return self.master_address

    def master_log(self, i: int) -> Path:
        """mooncake_master's own output on host i (glog's: its elections, warm-ups and
        restores, to place a fault's story), beside `master.log`, kvtier's lines about it."""
        return self.home(i) / "mooncake_master.log"

    def start_ha(self, leader: int, standby: int, etcd: int) -> None:
        """Mooncake's HA masters: etcd on host `etcd`, a master on `leader` started (and
        leading) first, then one on `standby`, both campaigning in that etcd."""
        addr = self.hosts.addresses[etcd]
        client, peer = f"http://{addr}:{ETCD_PORT}", f"http://{addr}:{ETCD_PORT + 1}"
        home = self.home(etcd)
        with open(home / "etcd.log", "ab") as log:
            proc = self.hosts.popen(etcd, ["etcd", "--name", "kvtier", "--data-dir",
                                    str(home / "etcd"), "--listen-client-urls", client,
                                    "--advertise-client-urls", client, "--listen-peer-urls",
                                    peer, "--initial-advertise-peer-urls", peer,
                                    "--initial-cluster", f"kvtier={peer}", "--log-level",
                                    "warn"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self._wait(etcd, f"{addr}:{ETCD_PORT}", "etcd", proc)
        self.etcd, self.etcd_host = f"{addr}:{ETCD_PORT}", etcd
        self.master_host = leader
        self.start_ha_master(leader)
        self.start_ha_master(standby)

    def ha_address(self, i: int) -> str:
        """The RPC address of host i's HA master."""
        return f"{self.hosts.addresses[i]}:{MASTER_PORT}"

    def leader(self) -> str | None:
        """The HA leader etcd names now (its RPC address), asked from etcd's host; None
        while none leads."""
        got = self._python(self.etcd_host, (
            "from kvtier.tiers.mooncake.ha import current_leader\n"
            f"l = current_leader([{self.etcd!r}])\nprint(l.address if l else '')"))
        return got.stdout.strip() or None

    def start_ha_master(self, i: int) -> None:
        """`kvtier master --ha` on host i, bound to its address; returns once it has joined
        the election (a standby answers no RPC until it leads)."""
        address = self.ha_address(i)
        policy = self.write_policy(i, "master.yaml")
        path = self.home(i) / "master.log"
        start = path.stat().st_size if path.exists() else 0
        with open(path, "ab") as log:
            proc = self.masters[i] = self.hosts.popen(
                i, kvtier_argv("master", "-p", str(policy), "--ha", "--address", address,
                               "--log", str(self.master_log(i))),
                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        end = time.monotonic() + START_S
        while b"joined the election" not in path.read_bytes()[start:]:
            if proc.poll() is not None or time.monotonic() > end:
                raise HostsError(f"the HA master on host {i} did not join the election "
                                 f"within {START_S:.0f}s; see {path}")
            time.sleep(0.2)

    def kill_ha_master(self, i: int) -> None:
        proc = self.masters.pop(i, None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _wait(self, i: int, address: str, what: str,
              proc: subprocess.Popen | None = None) -> None:
        """Until `address` answers from host i; `proc` (what serves it) must not exit."""
        end = time.monotonic() + START_S
        while not self.answers(i, address):
            if proc is not None and proc.poll() is not None:
                raise HostsError(f"{what} on host {i} exited with code {proc.returncode}; "
                                 f"see the logs under {self.home(i)}")
            if time.monotonic() > end:
                raise HostsError(f"{what} on host {i} did not answer at {address} within "
                                 f"{START_S:.0f}s; see the logs under {self.home(i)}")
            time.sleep(0.2)

    def answers(self, i: int, address: str, timeout_s: float = 0.5) -> bool:
        """Whether `address` accepts a TCP connection from host i."""
        host, port = address.rsplit(":", 1)
        return self._python(i, (
            "import socket,sys\ntry:\n socket.create_connection((%r,%s),timeout=%r)\n"
            "except OSError:\n sys.exit(1)" % (host, port, timeout_s))).returncode == 0

    def _python(self, i: int, code: str) -> subprocess.CompletedProcess:
        """Run Python `code` on host i; its output as text."""
        return subprocess.run(self.hosts.command(i, [sys.executable, "-c", code]),
                              capture_output=True, text=True, timeout=30)

    def close(self) -> None:
        """Stop everything on every host and delete the hosts (always safe to call)."""
        if self.volume is not None:  # its mounts go before the clients behind them
            self.volume.close()
            self.volume = None
        self.hosts.close()
        for proc in [self.master, *self.masters.values()]:
            if proc is not None:
                proc.wait(timeout=10)

    def __enter__(self) -> "HostCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()



class HostNode:
    """A kvtier node (`tools.hosts.agent`) on one host of a cluster, called op by op."""

    def __init__(self, cluster: HostCluster, i: int, name: str | None = None,
                 policy: Path | None = None, timeout_s: float = 60.0):
        self.i, self.name = i, name or f"host{i}"
        self.timeout_s = timeout_s
        policy = policy or cluster.write_policy(i)
        self.log_path = cluster.home(i) / f"{self.name}.log"
        with open(self.log_path, "ab") as log:
            self.proc = cluster.hosts.popen(
                i, [sys.executable, "-m", "kvtier.tools.hosts.agent", str(policy), self.name],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.announced = self._read()["ready"]

    def call(self, op: str, **args) -> dict:
        """Send one op; its reply (an `error` reply raises HostsError)."""
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        got = self._read()
        if "error" in got:
            raise HostsError(f"{self.name}: {op} failed: {got['error']}")
        return got

    def _read(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            tail = self.log_path.read_text(errors="replace")[-800:]
            raise HostsError(f"{self.name} did not answer within {self.timeout_s:.0f}s "
                             f"(exit {self.proc.poll()}); its log ends: {tail}")
        return json.loads(line)

    def close(self) -> None:
        """Ask it to exit; kill it if it does not within the timeout."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(self.timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class HostMaster:
    """The cluster's master as a fault injector drives one: `address`, `kill`, `stop`,
    `start` (again on the same host and address)."""

    def __init__(self, cluster: HostCluster, i: int):
        self.cluster, self.i = cluster, i

    @property
    def address(self) -> str:
        return self.cluster.master_address

    def start(self) -> "HostMaster":
        try:
            self.cluster.start_master(self.i)
        except HostsError as e:  # the injector retries a master that fails to start
            raise MasterError(str(e)) from None
        return self

    def kill(self) -> None:
        """SIGKILL `kvtier master` (its mooncake_master dies with it)."""
        proc = self.cluster.master
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        self.kill()
