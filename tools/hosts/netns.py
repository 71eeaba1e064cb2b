"""Several hosts on one machine: network namespaces joined by a bridge, for tests and replays.

`Hosts(k)` makes k hosts. Host i is the namespace `kvt<pid>-<n>h<i>` (cluster n of process
pid) with loopback up and one interface `eth0` at 198.18.0.<i+1>/24 (the benchmarking range,
RFC 2544: never routed to a real network); the other end of each host's veth pair sits in a
namespace of its own (`kvt<pid>-<n>br`), enslaved to a bridge there. No interface is made in
the machine's own namespace and no host has a default route, so traffic only ever goes
between these namespaces or stays on a host's own loopback. Each host's processes start
under `ip netns exec` (`command`), or a Python child enters one with `enter` (before it
starts threads: a namespace is per thread).

What a host shares with the others is the machine: one filesystem (so `/dev/shm` too: kvtier
must never take another host's segment file for its own), one clock, one pid space.

Teardown (`close`) kills every process left in the namespaces and deletes them; it runs from
`with`, from the atexit hook, and on SIGTERM/SIGINT via `on_signals`. Namespaces of a process
that died without it are swept when the next `Hosts` starts (`sweep`). Needs root
(CAP_SYS_ADMIN and CAP_NET_ADMIN): `unavailable()` says why not, for tests to skip with.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from kvtier.store.base.errors import KVTierError
from kvtier.store.base.index_record import owner_alive

NETNS_DIR = Path("/run/netns")
SUBNET = "198.18.0"  # hosts at .1 .. .k; a cluster's addresses are private to its bridge
MAX_HOSTS = 200
_NAME = re.compile(r"^kvt(\d+)-(\d+)(h\d+|br)$")
CLONE_NEWNET = 0x40000000
_SERIAL = itertools.count()  # several clusters of one process
STOP_S = 5.0


class HostsError(KVTierError):
    """The hosts cannot be made here; the message says what is missing."""


def unavailable() -> str | None:
    """Why hosts cannot be made on this machine, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in a container with NET_ADMIN)"
    if shutil.which("ip") is None:
        return "the `ip` command is missing (Debian package iproute2)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    got = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and got.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed: {got.stderr.strip()}")
    return got


def _pids(ns: str) -> list[int]:
    got = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in got.stdout.split()]


def _delete(ns: str) -> None:
    """Kill every process in `ns` (TERM, then KILL after STOP_S), then delete it."""
    pids = _pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + STOP_S
        while pids and time.monotonic() < end:
            time.sleep(0.05)
            pids = _pids(ns)
        if not pids:
            break
    _ip("netns", "del", ns, check=False)


def sweep() -> list[str]:
    """Delete the namespaces of clusters whose owner process is gone; returns their names."""
    gone = []
    for path in NETNS_DIR.glob("kvt*") if NETNS_DIR.is_dir() else ():
        m = _NAME.match(path.name)
        if m is None:
            continue
        try:
            made = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if not owner_alive(int(m.group(1)), made):
            _delete(path.name)
            gone.append(path.name)
    return gone


class Hosts:
    """k hosts (network namespaces) on one bridge; see the module docstring."""

    def __init__(self, k: int):
        why = unavailable()
        if why:
            raise HostsError(f"cannot make {k} hosts: {why}")
        if not 1 <= k <= MAX_HOSTS:
            raise HostsError(f"hosts must be 1..{MAX_HOSTS}, not {k}")
        sweep()
        self.k = k
        tag = f"kvt{os.getpid()}-{next(_SERIAL)}"
        self.bridge_ns = f"{tag}br"
        self.names = [f"{tag}h{i}" for i in range(k)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(k)]
        self._closed = False
        atexit.register(self.close)
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addresses)):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", br, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    # ---- running things on a host -----------------------------------------------------

    def command(self, i: int, argv: list[str]) -> list[str]:
        """`argv` to run on host i."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(i, argv), **kwargs)

    def enter(self, i: int) -> None:
        """Move the calling thread (and the threads it starts after) onto host i."""
        enter(self.names[i])

    def pids(self, i: int) -> list[int]:
        return _pids(self.names[i])

    # ---- faults -------------------------------------------------------------------------

    def cut(self, i: int) -> None:
        """Take host i off the network (its bridge port down); its loopback still works."""
        _ip("-n", self.bridge_ns, "link", "set", f"v{i}", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.bridge_ns, "link", "set", f"v{i}", "up")

    def kill(self, i: int) -> int:
        """Kill every process of host i (SIGKILL); returns how many there were."""
        pids = self.pids(i)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    # ---- teardown -----------------------------------------------------------------------

    def on_signals(self) -> None:
        """Tear down on SIGTERM and SIGINT too, then let the signal do what it did."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            before = signal.getsignal(sig)

            def handler(signum, frame, before=before):
                self.close()
                if callable(before):
                    before(signum, frame)
                else:
                    raise SystemExit(128 + signum)
            signal.signal(sig, handler)

    def close(self) -> None:
        """Kill every process of every host and delete the namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for ns in [*self.names, self.bridge_ns]:
            if (NETNS_DIR / ns).exists():
                _delete(ns)
        atexit.unregister(self.close)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_libc = ctypes.CDLL(None, use_errno=True)


def enter(ns: str) -> None:
    """setns(2) the calling thread into the named network namespace."""
    fd = os.open(NETNS_DIR / ns, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise HostsError(f"cannot enter network namespace {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)
