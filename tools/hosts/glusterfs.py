"""A GlusterFS volume, mounted through FUSE: a network filesystem to put the sharedfs tier
on in tests and replays.

`GlusterVolume(root)` starts a `glusterd` of its own (working dir under `root`, in a mount
namespace of its own with a private /run, so a glusterd the machine may already run is left
alone), makes a one-brick volume under `root/brick`, and mounts it at `root/mnt` through the
`glusterfs` FUSE client (TCP to the daemon on this machine). One volume per machine at a
time in this mode (the daemon's port 24007).

`GlusterVolume(root, hosts)` is a volume across the hosts of a `Hosts` cluster, as it is
deployed: a `glusterd` on every host (in the host's network namespace, bound to its
address, with a private /run each: the CLI's socket is per daemon), peers probed from host
0, one brick per host under `root/h<i>/brick` (replicated over every host for two or three
hosts, distributed over them for more), and the volume mounted on every host at
`root/h<i>/mnt`, its FUSE client in that host's network namespace (the mount itself is in
the machine's mount namespace, where every host's processes see files). So a host's reads
and writes cross the bridge to the bricks of the others, and a host cut off or killed takes
its brick and its client with it.

`close()` unmounts, stops the volume's processes and removes nothing of `root` but the
mounts. Needs root, the Debian packages glusterfs-server and glusterfs-client, and
/dev/fuse: `unavailable()` says what is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from xml.etree import ElementTree

from kvtier.tools.hosts.netns import NETNS_DIR, Hosts, HostsError

PORT = 24007
START_S = 30.0
VOLUME = "kvtier"
# A brick or client that stops answering is given up on after this long (GlusterFS's
# default, 42 s, would stall every host's I/O that long when one host goes away).
PING_TIMEOUT_S = 10


def unavailable(hosts: bool = False) -> str | None:
    """Why a volume cannot be made here (`hosts`: across namespaced hosts), or None."""
    if os.geteuid() != 0:
        return "GlusterFS needs root"
    missing = [b for b in ("glusterd", "gluster", "mount.glusterfs") if shutil.which(b) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (Debian packages glusterfs-server and "
                "glusterfs-client)")
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse (the GlusterFS client mounts through FUSE)"
    if not hosts:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", PORT)) == 0:
                return f"port {PORT} is taken (a glusterd already runs on this machine)"
    return None


class GlusterVolume:
    """A GlusterFS volume: one brick mounted at `mnt`, or with `hosts` a brick per host and
    a mount per host (`mounts[i]`, `bricks[i]`); a context manager."""

    def __init__(self, root: Path, hosts: Hosts | None = None):
        why = unavailable(hosts is not None)
        if why:
            raise HostsError(f"cannot make a GlusterFS volume: {why}")
        self.root = Path(root).absolute()  # glusterd takes absolute paths only
        self.hosts = hosts
        self.homes = [self.root] if hosts is None else \
            [self.root / f"h{i}" for i in range(hosts.k)]
        self.bricks = [h / "brick" for h in self.homes]
        self.mounts = [h / "mnt" for h in self.homes]
        for h in self.homes:
            for d in ("lib", "brick", "mnt"):
                (h / d).mkdir(parents=True, exist_ok=True)
        self.brick, self.mnt = self.bricks[0], self.mounts[0]
        self.daemons: list[subprocess.Popen] = []
        self.mounted: list[Path] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        for i, home in enumerate(self.homes):
            self.daemons.append(self._daemon(i, home))
        for i, (home, daemon) in enumerate(zip(self.homes, self.daemons)):
            end = time.monotonic() + START_S
            while self.gluster("volume", "list", check=False, on=i).returncode != 0:
                if daemon.poll() is not None or time.monotonic() > end:
                    raise HostsError(f"glusterd did not start; see {home / 'glusterd.log'}")
                time.sleep(0.3)
        if self.hosts is None:
            # GlusterFS refuses loopback addresses for bricks: the machine's name
            addresses = [socket.gethostname()]
        else:
            addresses = self.hosts.addresses
            for address in addresses[1:]:
                self.gluster("peer", "probe", address)
            self._wait_for_peers(len(addresses) - 1)
        bricks = [f"{a}:{b}" for a, b in zip(addresses, self.bricks)]
        layout = ["replica", str(len(bricks))] if len(bricks) in (2, 3) else []
        self.gluster("volume", "create", VOLUME, *layout, *bricks, "force")
        self.gluster("volume", "set", VOLUME, "network.ping-timeout", str(PING_TIMEOUT_S))
        self.gluster("volume", "start", VOLUME)
        for i, address in enumerate(addresses):
            self._mount(i, address)

    def _mount(self, i: int, address: str) -> None:
        mnt = self.mounts[i]
        mount = ["mount", "-t", "glusterfs", f"{address}:/{VOLUME}", str(mnt)]
        if self.hosts is not None:  # the client on host i, the mount seen machine-wide
            mount = ["nsenter", f"--net={NETNS_DIR / self.hosts.names[i]}", *mount]
        got = subprocess.run(mount, capture_output=True, text=True, timeout=60)
        if got.returncode != 0:
            raise HostsError(f"mounting the GlusterFS volume on {address} failed: "
                             f"{got.stderr.strip()}")
        self.mounted.append(mnt)

    def restart(self, i: int) -> None:
        """Host i's processes were killed (its daemon, brick and client): start its daemon
        again (it brings its brick back and heals it from the others' replicas) and mount
        the volume there again, as a rebooted host would."""
        if self.hosts is None:
            raise HostsError("restart is for a volume across hosts")
        self.daemons[i].wait(timeout=10)
        mnt = self.mounts[i]
        if mnt in self.mounted:  # its client is gone: the mount only errs now
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
            self.mounted.remove(mnt)
        self.daemons[i] = self._daemon(i, self.homes[i])
        address = self.hosts.addresses[i]
        end = time.monotonic() + START_S
        while not self._brick_online(i):
            if self.daemons[i].poll() is not None or time.monotonic() > end:
                raise HostsError(f"the GlusterFS brick on {address} did not come back; see "
                                 f"{self.homes[i] / 'glusterd.log'}")
            time.sleep(0.3)
        self._mount(i, address)

    def _daemon(self, i: int, home: Path) -> subprocess.Popen:
        """Host i's glusterd (the machine's without hosts), its /run private."""
        vol = home / "glusterd.vol"
        # glusterd builds the transport to a probed peer from these keepalive options and
        # fails the probe (`connect returned -2`) when they are missing
        bind = "" if self.hosts is None else \
            f"    option transport.socket.bind-address {self.hosts.addresses[i]}\n"
        vol.write_text(f"volume management\n    type mgmt/glusterd\n"
                       f"    option working-directory {home / 'lib'}\n"
                       f"    option transport-type socket\n"
                       f"    option transport.address-family inet\n{bind}"
                       f"    option transport.socket.keepalive-time 10\n"
                       f"    option transport.socket.keepalive-interval 2\n"
                       f"    option transport.socket.tcp-user-timeout {PING_TIMEOUT_S}\n"
                       f"    option transport.socket.listen-port {PORT}\n"
                       f"    option ping-timeout 0\n    option event-threads 1\nend-volume\n")
        run = (f"mount -t tmpfs tmpfs /run && exec glusterd -N -f {vol} "
               f"--log-file {home / 'glusterd.log'}")
        argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", run]
        kw = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        # `ip netns exec` and `unshare` exec: the pid is glusterd's
        return self.hosts.popen(i, argv, **kw) if self.hosts else subprocess.Popen(argv, **kw)

    def _brick_online(self, i: int) -> bool:
        """Whether host i's brick process serves (the CLI's XML: its plain text wraps long
        brick paths)."""
        got = self.gluster("volume", "status", VOLUME, "--xml", check=False, on=i)
        try:
            nodes = ElementTree.fromstring(got.stdout).iter("node")
        except ElementTree.ParseError:
            return False
        return any(n.findtext("hostname") == self.hosts.addresses[i]
                   and n.findtext("path") == str(self.bricks[i])
                   and n.findtext("status") == "1" for n in nodes)

    def _wait_for_peers(self, n: int) -> None:
        end = time.monotonic() + START_S
        while True:
            status = self.gluster("peer", "status").stdout
            if len(re.findall(r"State: Peer in Cluster \(Connected\)", status)) == n:
                return
            if time.monotonic() > end:
                raise HostsError(f"GlusterFS peers did not join: {status.strip()}")
            time.sleep(0.3)

    def gluster(self, *args: str, check: bool = True, on: int = 0
                ) -> subprocess.CompletedProcess:
        """The gluster CLI, talking to daemon `on` (inside its mount namespace)."""
        cmd = ["nsenter", "-t", str(self.daemons[on].pid), "-m", "gluster", "--mode=script",
               *args]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if check and got.returncode != 0:
            raise HostsError(f"gluster {' '.join(args)} failed: "
                             f"{(got.stderr or got.stdout).strip()}")
        return got

    def close(self) -> None:
        """Unmount and stop every process of the volume. Idempotent."""
        for mnt in self.mounted:
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        self.mounted = []
        if self.daemons:
            for pid in self._processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for daemon in self.daemons:
                daemon.wait(timeout=10)
            self.daemons = []

    def _processes(self) -> list[int]:
        """The daemons, their brick processes, clients and helpers (all name this volume's
        dirs)."""
        out = [d.pid for d in self.daemons]
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "gluster" in cmd and str(self.root) in cmd:
                out.append(int(d.name))
        return out

    def __enter__(self) -> "GlusterVolume":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
