"""A kvtier cluster over `Hosts`: a master on one host, a home per host, one shared dir.

`HostCluster(k, root)` makes k hosts (`tools.hosts.netns`), a home directory per host under
`root` (its index, nvme dir and run dir: nothing of one host's node state is seen by
another) and `root/shared`, the one directory every host uses as its sharedfs tier (the
shared filesystem). `start_master(i)` runs `kvtier master` on host i, bound to that host's
address. `policy(i)` is host i's policy: the embedded defaults with only the master's
address given (so `local_hostname` is unset: cross-host by default) and tiers sized for a
test. Processes of a host start with `hosts.popen(i, ...)`; `HostNode` runs a kvtier node
there and calls it op by op.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

import yaml

from kvtier.tools.hosts.netns import Hosts, HostsError

MASTER_PORT = 50051
START_S = 30.0
TIERS = ("dram", "nvme", "shared")


def kvtier_argv(*args: str) -> list[str]:
    """The kvtier CLI of this interpreter, as a command line."""
    return [sys.executable, "-c", "from kvtier.tools.cli import main; main()", *args]


class HostCluster:
    """k hosts with a master, homes and a shared dir; a context manager."""

    def __init__(self, k: int, root: Path, dram: str = "64MiB"):
        self.root = Path(root)
        self.dram = dram
        self.hosts = Hosts(k)
        self.shared = self.root / "shared"
        self.shared.mkdir(parents=True, exist_ok=True)
        self.master_host: int | None = None
        self.master: subprocess.Popen | None = None

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
            "shared": {"name": "shared", "kind": "sharedfs", "path": str(self.shared),
                       "capacity": "1GiB"},
        }
        return {"chunk_tokens": 256,
                "index": {"path": str(home / "index"), "map_size": "64MiB"},
                "master": {"address": self.master_address if self.master_host is not None
                           else f"{self.hosts.addresses[i]}:{MASTER_PORT}",
                           "embedded": False, "run_dir": str(home / "run")},
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
        self.master = self.hosts.popen(i, kvtier_argv("master", "-p", str(policy)),
                                       stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        end = time.monotonic() + START_S
        while time.monotonic() < end:
            if self.master.poll() is not None:
                raise HostsError(f"kvtier master on host {i} exited with code "
                                 f"{self.master.returncode}; see {self.home(i) / 'master.log'}")
            if self.answers(i, self.master_address):
                return self.master_address
            time.sleep(0.2)
        raise HostsError(f"the master on host {i} did not answer within {START_S:.0f}s")

    def answers(self, i: int, address: str, timeout_s: float = 0.5) -> bool:
        """Whether `address` accepts a TCP connection from host i."""
        host, port = address.rsplit(":", 1)
        probe = ("import socket,sys\ntry:\n socket.create_connection((%r,%s),timeout=%r)\n"
                 "except OSError:\n sys.exit(1)" % (host, port, timeout_s))
        got = subprocess.run(self.hosts.command(i, [sys.executable, "-c", probe]),
                             capture_output=True, timeout=30)
        return got.returncode == 0

    def close(self) -> None:
        """Stop everything on every host and delete the hosts (always safe to call)."""
        self.hosts.close()
        if self.master is not None:
            self.master.wait(timeout=10)

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
