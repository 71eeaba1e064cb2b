"""A throwaway single-member etcd on loopback, for what kvtier runs itself: the HA benchmark,
replays and tests of Mooncake's HA mode. Production etcd is the operator's (README).

`LocalEtcd(data_dir).start()` runs Debian's `etcd` (package `etcd-server`, 3.4) with its
client and peer ports on free loopback ports and its data under `data_dir`, waits until it
reports healthy, and stops like every kvtier child process (SIGTERM, then SIGKILL; the
kernel ends it if its owner dies first). `endpoint` is the `HOST:PORT` clients are given.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

from kvtier.store.base.errors import MasterError
from kvtier.tiers.mooncake.master import ChildProcess, free_port, private_file

INSTALL_HINT = "apt-get install etcd-server"
START_TIMEOUT_S = 20.0


def etcd_binary() -> Path | None:
    """The `etcd` server on PATH, or None."""
    found = shutil.which("etcd")
    return Path(found) if found else None


class LocalEtcd(ChildProcess):
    """One etcd member on `host` (loopback), its data in `data_dir`."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1"):
        self.data_dir = Path(data_dir)
        self.host = host
        self.client_port = 0
        self.peer_port = 0
        self.log_path = self.data_dir / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def command(self, binary: Path) -> list[str]:
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [str(binary), "--name", "kvtier", "--data-dir", str(self.data_dir / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kvtier={peer}", "--log-level", "warn"]

    def start(self) -> "LocalEtcd":
        binary = etcd_binary()
        if binary is None:
            raise MasterError(f"etcd not found on PATH; install it: {INSTALL_HINT}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.client_port, self.peer_port = free_port(self.host), free_port(self.host)
        self._log = private_file(self.log_path, "ab")
        self._spawn(binary, self.command(binary), self._log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MasterError(f"etcd exited with code {self.proc.returncode} at start; "
                                  f"see {self.log_path}")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise MasterError(f"etcd did not report healthy on {self.endpoint} within "
                          f"{START_TIMEOUT_S:.0f}s; see {self.log_path}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=0.5) as r:
                return json.load(r).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        super().stop(timeout_s)
        if self.proc is None and self.data_dir.exists():
            # etcd's write-ahead log preallocates 64 MiB: leave none behind.
            shutil.rmtree(self.data_dir / "data", ignore_errors=True)
