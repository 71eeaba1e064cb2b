"""The embedded Mooncake master: find the binary, start it on loopback, join or own it.

`EmbeddedMaster` starts the `mooncake_master` of the installed wheel with kvtier's flags on
127.0.0.1 (RPC, and the metrics/admin port on a free port), waits until it answers, and stops
it cleanly. `ensure_master(cfg)` is what a kvtier process calls with `master.embedded: true`:
it joins the master that answers at `cfg.address` and starts one (owning it) only when none
answers, under a file lock so two processes starting at once end up on one master.

With `master.etcd` (Mooncake's HA mode, `tiers.mooncake.ha`) `EmbeddedMaster` starts a master
that joins the election: it is ready once it leads and serves, or stands by behind a leader.
`master_reachable(cfg)` is the probe every caller makes before Mooncake's own connect (which
blocks for many seconds when nothing answers): the address, or the leader etcd names.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvtier.store.base.config import MasterConfig
from kvtier.store.base.errors import MasterError
from kvtier.store.base.index import make_private_dirs
from kvtier.tiers.mooncake import ha

DEBIAN_PACKAGES = "libibverbs1 librdmacm1 libnuma1"
# How many times a start picks its ports again when one was taken between pick and bind.
PORT_ATTEMPTS = 3
INSTALL_HINT = ("pip install 'kvtier[cpu]' (mooncake-transfer-engine-non-cuda) or "
                "'kvtier[cuda]' (mooncake-transfer-engine)")


def find_master_binary() -> Path:
    """The `mooncake_master` beside this Python, or inside the mooncake package, or on PATH."""
    return find_mooncake_binary("mooncake_master")


def find_mooncake_binary(name: str) -> Path:
    """The wheel's binary `name` beside this Python, inside the mooncake package, or on PATH."""
    candidates = [Path(sys.prefix) / "bin" / name]
    try:
        import importlib.util
        spec = importlib.util.find_spec("mooncake")
        if spec is not None and spec.origin:
            candidates.append(Path(spec.origin).parent / name)
    except (ImportError, ValueError):
        pass
    on_path = shutil.which(name)
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise MasterError(f"{name} not found; install it: {INSTALL_HINT}")


def check_shared_libraries(binary: Path) -> None:
    """Raise MasterError naming the Debian packages when the binary's libraries are missing."""
    try:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return  # no ldd: the start itself will report the failure
    missing = sorted({line.split()[0] for line in out.splitlines() if "not found" in line})
    if missing:
        raise MasterError(f"{binary.name} cannot load {', '.join(missing)}; install the Debian "
                          f"packages: apt-get install {DEBIAN_PACKAGES}")


def die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the owning process dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the owner died before prctl took effect
        os._exit(1)


def private_file(path: Path, mode: str):
    """`open(path, mode)` ("w" or "ab"), creating the file 0600 whatever the umask allows
    (a master log names its clients, segments and keys)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if "a" in mode else 0)
    return os.fdopen(os.open(path, flags, 0o600), mode)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_answers(address: str, timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections at `host:port`."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def master_reachable(cfg: MasterConfig, timeout_s: float = 0.5) -> bool:
    """True if the master a client of `cfg` would use answers: at `cfg.address`, or in HA
    mode the leader etcd names (a lapsed or dead leader, or etcd down, is False)."""
    if not cfg.ha:
        return master_answers(cfg.address, timeout_s)
    leader = ha.current_leader(cfg.etcd, timeout_s)
    return leader is not None and master_answers(leader.address, timeout_s)


class ChildProcess:
    """A server kvtier runs as a child process (`proc`, its log file `_log`): subclasses
    start it; this stops, kills and answers whether it is alive. A context manager."""

    proc: subprocess.Popen | None = None
    _log = None
    detached = False  # True: outlives its starter (`kvtier master --detach`)

    def start(self) -> "ChildProcess":
        raise NotImplementedError

    def _spawn(self, binary: Path, command: list[str], log,
               env: dict[str, str] | None = None) -> None:
        """Run `command` with output to `log` (`env`: variables added to this process's).
        The owner's death ends the child: no orphan keeps ports or memory, and the processes
        that joined it start a new one when they notice (`ensure_master`, `ensure_service`)."""
        try:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env={**os.environ, **env} if env else None,
                                         preexec_fn=None if self.detached else die_with_parent)
        except OSError as e:
            raise MasterError(f"cannot run {binary}: {e.strerror}; reinstall: {INSTALL_HINT}"
                              ) from None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL at once (fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class EmbeddedMaster(ChildProcess):
    """A `mooncake_master` child process on loopback. Use as a context manager or start/stop."""

    def __init__(self, cfg: MasterConfig | None = None, rpc_port: int | None = None,
                 log_path: Path | None = None):
        self.cfg = cfg or MasterConfig()
        self.host = self.cfg.host
        self.rpc_port = self.cfg.port if rpc_port is None else rpc_port
        self.metrics_port = 0
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        cfg = self.cfg
        flags = {
            "rpc_address": self.host,
            "rpc_port": str(self.rpc_port),
            "metrics_host": self.host,
            "metrics_port": str(self.metrics_port),
            "enable_http_metadata_server": "false",
            "default_kv_lease_ttl": str(cfg.default_kv_lease_ttl_ms),
            "default_kv_soft_pin_ttl": str(cfg.default_kv_soft_pin_ttl_ms),
            "eviction_high_watermark_ratio": str(cfg.eviction_high_watermark_ratio),
            "eviction_ratio": str(cfg.eviction_ratio),
        }
        if cfg.ha:
            flags |= {"enable_ha": "true", "etcd_endpoints": ";".join(cfg.etcd),
                      # Standbys follow the leader's op log in etcd, so the one that takes
                      # over knows every object and segment (without it the pool is emptied
                      # by a failover: README, "Master high availability").
                      "enable_oplog": "true"}
        flags |= cfg.extra_flags
        return [str(find_master_binary()), *(f"-{k}={v}" for k, v in flags.items())]

    def start(self) -> "EmbeddedMaster":
        """Start the master and wait until it serves. The admin port is always picked free
        here, and the RPC port too when the address gives port 0 (`cfg.address` then names
        the one picked): a port taken between the pick and the master's bind (by another
        process's listener or outgoing connection) is picked again, `PORT_ATTEMPTS` times."""
        binary = find_master_binary()
        check_shared_libraries(binary)
        if self.cfg.ha and self.host in ("0.0.0.0", "::", ""):
            raise MasterError(f"an HA master publishes its address to clients through etcd; "
                              f"bind this host's address, not {self.host} (master.address or "
                              "--address)")
        pick_rpc = self.rpc_port == 0
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if pick_rpc:
                self.rpc_port = free_port(self.host)
                self.cfg = self.cfg.model_copy(update={"address": self.address})
            if master_answers(self.address):
                if pick_rpc and attempt < PORT_ATTEMPTS:
                    continue
                raise MasterError(f"port {self.address} is already in use; stop what listens "
                                  "there or set master.address to a free port")
            self.metrics_port = free_port(self.host)
            log_start = self._log_size()
            log = private_file(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
            self._log = log if self.log_path else None
            self._spawn(binary, self.command(), log)
            try:
                self._wait_ready()
                return self
            except MasterError:
                self.stop()  # exited, or never ready: either way not ours to keep
                picked = [self.metrics_port] + ([self.rpc_port] if pick_rpc else [])
                if attempt == PORT_ATTEMPTS or not self._port_taken(log_start, picked):
                    raise
        raise AssertionError("unreachable")

    def _log_size(self) -> int:
        try:
            return Path(self.log_path).stat().st_size if self.log_path else 0
        except OSError:
            return 0

    def _port_taken(self, log_start: int, ports: list[int]) -> bool:
        """True if this start's log says one of `ports` was in use (no log: cannot tell)."""
        if not self.log_path:
            return False
        try:
            with open(self.log_path, "rb") as f:
                f.seek(log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        return any("in use" in line and any(f":{p}" in line for p in ports)
                   for line in text.splitlines())

    def health(self) -> dict | None:
        """The master's own `/health` (HA role and state, the leader it sees), or None."""
        return ha.master_health(f"{self.host}:{self.metrics_port}")

    def _ready(self) -> bool:
        if self.cfg.ha:  # a standby never answers on its RPC port: ask its admin port
            return ha.joined(ha.master_health(f"{self.host}:{self.metrics_port}", 0.2),
                             self.address)
        # The master binds its RPC port before its admin port and exits when the admin port
        # is taken: it serves once both answer, the admin port with the master's own health.
        if not master_answers(self.address, 0.2):
            return False
        health = ha.master_health(f"{self.host}:{self.metrics_port}", 0.2)
        return bool(health) and health.get("status") == "ok"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MasterError(f"mooncake_master exited with code {self.proc.returncode} at "
                                  f"start{self._log_tail()}; see the log or run `kvtier master`")
            if self._ready():
                return
            time.sleep(0.05)
        self.stop()
        what = ("join the election through etcd " + ",".join(self.cfg.etcd) if self.cfg.ha
                else f"answer on {self.address}")
        raise MasterError(f"mooncake_master did not {what} within "
                          f"{self.cfg.start_timeout_s:.0f}s; raise master.start_timeout_s"
                          + (" or check that etcd answers" if self.cfg.ha else ""))

    def _log_tail(self) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        lines = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        errors = [ln for ln in lines if ln[:1] in "EF"]
        return f" ({(errors or lines or [''])[-1][:200]})"

def ensure_master(cfg: MasterConfig, lock_dir: Path | None = None) -> EmbeddedMaster | None:
    """Join the master at `cfg.address`, or start and own one when none answers.

    Returns the owned master, or None when joining another's. An owned master lives as long as
    its owner: it is stopped at interpreter exit and killed by the kernel if the owner dies
    (PR_SET_PDEATHSIG); processes that joined it see the tier go unavailable and call this
    again, so one of them becomes the new owner. With `embedded: false`, a master that does
    not answer is an error.
    """
    if master_reachable(cfg):
        return None
    if cfg.ha:
        raise MasterError(f"no Mooncake master leads at {cfg.client_address}; start masters "
                          "with `kvtier master --ha` and check that etcd answers")
    if not cfg.embedded:
        raise MasterError(f"no Mooncake master answers at {cfg.address}; start one "
                          "(`kvtier master`) or set master.embedded: true")
    lock_dir = lock_dir or cfg.runtime_dir
    return start_unless_answering(
        cfg.address, lock_dir / f"master-{cfg.port}.lock",
        lambda: EmbeddedMaster(cfg, log_path=lock_dir / f"master-{cfg.port}.log").start())


def start_unless_answering(address: str, lock_path: Path, start) -> "ChildProcess | None":
    """`start()` a child to serve `address` and own it, unless something answers there.

    Of processes racing here, the one holding the exclusive lock on `lock_path` checks again
    and starts the child; the others then find it answering and get None (they join it). An
    owned child is stopped at interpreter exit.
    """
    make_private_dirs(lock_path.parent)
    with private_file(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if master_answers(address):
            return None
        child = start()
    atexit.register(child.stop)
    return child
