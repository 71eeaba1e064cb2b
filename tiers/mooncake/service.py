"""The node's pool service: Mooncake's standalone client (`mooncake_client`) on loopback.

With `service` set on a mooncake tier, one service process per node lends the node's segment
to the pool and every kvtier process on the node joins it as a "dummy" client: frames move
between the process and the service through shared memory (memfd, passed once over a unix
socket), and only the service talks to the master and to other nodes' segments.

Measured here (0.3.13.post1, 512 x 32 KiB objects put by one process, read by another, medians
of 9): 5.3 ms through the service against 20.6 ms between two embedded clients over TCP.

`PoolService` starts and stops one service; `ensure_service` joins the one answering at the
tier's `service` address or, with `service_embedded: true`, starts one (owned by the caller,
gone when it dies, like an embedded master) under a file lock. The service binds its RPC port
to the address's host; its transfer engine listens on every interface (Mooncake 0.3 has no
setting for that, as for embedded clients: README, "Known limits").
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from kvtier.store.base.config import MasterConfig, MooncakeTierConfig
from kvtier.store.base.errors import MasterError
from kvtier.store.base.index import make_private_dirs
from kvtier.tiers.mooncake.master import (ChildProcess, check_shared_libraries,
                                 find_mooncake_binary, master_answers, private_file,
                                 start_unless_answering)

BINARY = "mooncake_client"
START_TIMEOUT_S = 20.0
# The service's own segment, as the master names it: its log says which host and port its
# transfer engine took (not the handshake port it also logs).
_SEGMENT_LINE = re.compile(rb"parseHostNameWithPort\. server_name: (\S+) port: (\d+)")


class PoolService(ChildProcess):
    """One `mooncake_client` process lending `cfg.capacity` bytes on behalf of the node."""

    def __init__(self, cfg: MooncakeTierConfig, master: MasterConfig,
                 log_path: Path | None = None, extra_flags: dict[str, str] | None = None,
                 env: dict[str, str] | None = None):
        """`extra_flags` are added to the command line and `env` to the environment (what
        kvtier does not set itself: Mooncake's own SSD offload, for the peer benches)."""
        if cfg.service is None:
            raise ValueError(f"tier {cfg.name!r} has no service address")
        self.cfg = cfg
        self.master = master
        self.address = cfg.service
        self.extra_flags, self.env = dict(extra_flags or {}), dict(env or {})
        # The default place is where joining clients look for the service's segment name.
        self.log_path = log_path or service_log(cfg, master.runtime_dir)
        self.proc: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        cfg = self.cfg
        host, port = self.address.rsplit(":", 1)
        flags = {
            "master_server_address": self.master.client_address,
            "metadata_server": self.master.metadata_server,
            "host": host,
            "port": port,
            "global_segment_size": str(cfg.capacity_bytes),
            "local_buffer_size": str(cfg.buffer_bytes),
            "protocol": cfg.protocol,
            "device_names": cfg.device,
            "threads": str(cfg.service_threads),
        } | self.extra_flags
        return [str(find_mooncake_binary(BINARY)), *(f"-{k}={v}" for k, v in flags.items())]

    def start(self) -> "PoolService":
        binary = find_mooncake_binary(BINARY)
        check_shared_libraries(binary)
        if master_answers(self.address):
            raise MasterError(f"port {self.address} is already in use; stop what listens there "
                              f"or set the tier's service to a free port")
        make_private_dirs(self.log_path.parent)
        self._log = private_file(self.log_path, "ab")
        self._spawn(binary, self.command(), self._log, self.env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MasterError(f"{BINARY} exited with code {self.proc.returncode} at start; "
                                  f"see {self.log_path} (is the master at "
                                  f"{self.master.client_address} up?)")
            if master_answers(self.address, 0.2):
                self._publish_segment()
                return self
            time.sleep(0.02)
        self.stop()
        raise MasterError(f"the pool service did not answer on {self.address} within "
                          f"{START_TIMEOUT_S:.0f}s; see {self.log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the service and withdraw its segment name (left behind, one small file per
        port would pile up in the temp dir, and name a segment that no longer exists)."""
        super().stop(timeout_s)
        segment_file(self.address, self.master.runtime_dir).unlink(missing_ok=True)

    def _publish_segment(self) -> None:
        """Write the segment's name where every process on the node finds it by port."""
        segment = service_segment(self.log_path)
        if segment is None:
            return  # an unknown log format: clients place without preferring it
        path = segment_file(self.address, self.master.runtime_dir)
        make_private_dirs(path.parent)
        tmp = path.with_name(path.name + f".{os.getpid()}")
        with private_file(tmp, "w") as f:
            f.write(segment)
        os.replace(tmp, path)


def service_log(cfg: MooncakeTierConfig, run_dir: Path) -> Path:
    """Where a kvtier-started service for `cfg.service` writes its log (the policy's run
    dir, `master.run_dir`)."""
    return run_dir / f"pool-{cfg.service.rsplit(':', 1)[1]}.log"


def segment_file(address: str, run_dir: Path) -> Path:
    """Where the service on `address` names its segment (one per port in a run dir)."""
    return run_dir / f"pool-{address.replace(':', '-')}.segment"


def read_segment(address: str, run_dir: Path) -> str:
    """The segment of the service on `address` as its starter published it, or "" if none
    did (a service started by hand): clients then place objects without preferring it."""
    try:
        return segment_file(address, run_dir).read_text().strip()
    except OSError:
        return ""


def service_segment(log_path: Path) -> str | None:
    """The segment name of the service that writes `log_path` (its latest start), or None."""
    try:
        data = log_path.read_bytes()
    except OSError:
        return None
    found = _SEGMENT_LINE.findall(data)
    return b":".join(found[-1]).decode() if found else None


def ensure_service(cfg: MooncakeTierConfig, master: MasterConfig,
                   home: Path | None = None) -> PoolService | None:
    """Join the service answering at `cfg.service`, or start and own one when none answers.

    Returns the owned service, or None when joining another's. An owned service lives as long
    as its owner (stopped at exit, killed by the kernel if the owner dies); the processes that
    joined it see the tier go unavailable and call this again, and one of them starts the next.
    """
    if master_answers(cfg.service):
        return None
    if not cfg.service_embedded:
        raise MasterError(f"no pool service answers at {cfg.service}; start one (`kvtier "
                          "pool-service`) or set service_embedded: true")
    home = home or master.runtime_dir
    port = cfg.service.rsplit(":", 1)[1]
    return start_unless_answering(
        cfg.service, home / f"pool-{port}.lock",
        lambda: PoolService(cfg, master, log_path=service_log(cfg, home)).start())
