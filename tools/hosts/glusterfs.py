"""A GlusterFS volume on this machine, mounted through FUSE: a network filesystem to put the
sharedfs tier on in tests and replays.

`GlusterVolume(root)` starts a `glusterd` of its own (working dir under `root`, in a mount
namespace of its own with a private /run, so a glusterd the machine may already run is left
alone), makes a one-brick volume under `root/brick`, and mounts it at `root/mnt` through the
`glusterfs` FUSE client (TCP to the daemon on this machine). Every host of a `Hosts` cluster sees
the mount (namespaced hosts share the machine's filesystem). `close()` unmounts, stops the
volume's processes and removes nothing of `root` but the mount. Needs root, the Debian
packages glusterfs-server and glusterfs-client, and /dev/fuse: `unavailable()` says what is
missing. One volume per machine at a time (the daemon's port 24007).

A brick per host is not done: each namespaced `glusterd` also wants the machine's
/run/glusterd.socket, and a peer probe between namespaced daemons hung here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from kvtier.tools.hosts.netns import HostsError

PORT = 24007
START_S = 30.0
VOLUME = "kvtier"


def unavailable() -> str | None:
    """Why a volume cannot be made here, or None."""
    if os.geteuid() != 0:
        return "GlusterFS needs root"
    missing = [b for b in ("glusterd", "gluster", "mount.glusterfs") if shutil.which(b) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (Debian packages glusterfs-server and "
                "glusterfs-client)")
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse (the GlusterFS client mounts through FUSE)"
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", PORT)) == 0:
            return f"port {PORT} is taken (a glusterd already runs on this machine)"
    return None


class GlusterVolume:
    """A one-brick GlusterFS volume mounted at `mnt`; a context manager."""

    def __init__(self, root: Path):
        why = unavailable()
        if why:
            raise HostsError(f"cannot make a GlusterFS volume: {why}")
        self.root = Path(root)
        self.lib, self.brick, self.mnt = (self.root / n for n in ("lib", "brick", "mnt"))
        for d in (self.lib, self.brick, self.mnt):
            d.mkdir(parents=True, exist_ok=True)
        self.log = self.root / "glusterd.log"
        self.daemon: subprocess.Popen | None = None
        self.mounted = False
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        vol = self.root / "glusterd.vol"
        vol.write_text(f"volume management\n    type mgmt/glusterd\n"
                       f"    option working-directory {self.lib}\n"
                       f"    option transport-type socket\n"
                       f"    option transport.socket.listen-port {PORT}\n"
                       f"    option ping-timeout 0\n    option event-threads 1\nend-volume\n")
        run = (f"mount -t tmpfs tmpfs /run && exec glusterd -N -f {vol} "
               f"--log-file {self.log}")
        self.daemon = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                        run], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        end = time.monotonic() + START_S
        while self.gluster("volume", "list", check=False).returncode != 0:
            if self.daemon.poll() is not None or time.monotonic() > end:
                raise HostsError(f"glusterd did not start; see {self.log}")
            time.sleep(0.3)
        # GlusterFS refuses loopback addresses for bricks: the machine's name
        host = socket.gethostname()
        self.gluster("volume", "create", VOLUME, f"{host}:{self.brick}", "force")
        self.gluster("volume", "start", VOLUME)
        got = subprocess.run(["mount", "-t", "glusterfs", f"{host}:/{VOLUME}",
                              str(self.mnt)], capture_output=True, text=True, timeout=60)
        if got.returncode != 0:
            raise HostsError(f"mounting the GlusterFS volume failed: {got.stderr.strip()}")
        self.mounted = True

    def gluster(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """The gluster CLI, talking to this volume's daemon (inside its mount namespace)."""
        cmd = ["nsenter", "-t", str(self.daemon.pid), "-m", "gluster", "--mode=script", *args]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if check and got.returncode != 0:
            raise HostsError(f"gluster {' '.join(args)} failed: "
                             f"{(got.stderr or got.stdout).strip()}")
        return got

    def close(self) -> None:
        """Unmount and stop every process of the volume. Idempotent."""
        if self.mounted:
            if subprocess.run(["umount", str(self.mnt)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
            self.mounted = False
        if self.daemon is not None:
            for pid in self._processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.daemon.wait(timeout=10)
            self.daemon = None

    def _processes(self) -> list[int]:
        """The daemon, its brick process and its helpers (all name this volume's dirs)."""
        out = [self.daemon.pid]
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "gluster" in cmd and (str(self.lib) in cmd or str(self.brick) in cmd
                                     or f"/{VOLUME}" in cmd and str(self.mnt) in cmd):
                out.append(int(d.name))
        return out

    def __enter__(self) -> "GlusterVolume":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
