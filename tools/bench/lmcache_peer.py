"""The LMCache peer of `kvtier bench vllm --peers`: vLLM's `LMCacheMPConnector` and one
`lmcache server` both engines join.

LMCache is not a kvtier dependency: it lives in a venv of its own (`make peers` builds
`.venv-peers/lmcache`: lmcache installed without its pinned dependencies, which would
replace vLLM's, plus the few it imports; vLLM and kvtier reached from there), found under
`$KVTIER_PEERS_DIR` or the checkout's `.venv-peers`. Without it the peer is skipped, saying
so. As its users run it on a CPU build:

- the server keeps blocks in its L1 (DRAM, LRU) in its own process, so they outlive the
  engine that saved them; it is told to accept engine-driven transfers (`--supported-
  transfer-mode auto`): on CPU the connector copies KV itself (`engine_driven`), while the
  server's default expects to pull it over CUDA IPC or shared memory;
- its chunk is LMCache's default, 256 tokens (a hit is whole chunks, plus the prompt's
  tail, which it stores too);
- its engines run as vLLM multi-process engines: in one process, vLLM's CPU kernel
  overrides scan every loaded module and fail on one that LMCache's imports bring in
  (llvmlite's `ffi.lib`), so the engine does not start;
- usage telemetry is off (`LMCACHE_TRACK_USAGE=false`, `DO_NOT_TRACK=1`).

Saves are settled on the server's L1 object count (`/status`).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from kvtier.tiers.mooncake.master import die_with_parent, free_port
from kvtier.tools.bench.peer_systems import PeerUnavailable, System

QUIET_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
START_TIMEOUT_S = 180.0  # the server imports torch and LMCache's native modules
L1_BYTES = 2 << 30


def l1_size_arg(l1_bytes: int) -> str:
    """`--l1-size-gb` for an L1 of `l1_bytes`: the server reads GiB and keeps
    `int(value * 2**30)` bytes, so the pool's bytes go through unchanged."""
    return repr(l1_bytes / (1 << 30))


def peers_dir() -> Path:
    """Where the peers' venvs are: `$KVTIER_PEERS_DIR`, else the checkout's `.venv-peers`."""
    env = os.environ.get("KVTIER_PEERS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".venv-peers"


def venv_problem(venv: Path) -> str | None:
    """Why `venv` cannot run the peer (one line), or None."""
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no LMCache venv at {venv}: run `make peers`"
    probe = ("import importlib.util as u, sys; sys.exit(0 if u.find_spec('lmcache') and "
             "u.find_spec('kvtier.connector.harness.engine_host') and u.find_spec('vllm') "
             "else 1)")
    if subprocess.run([str(python), "-c", probe], capture_output=True).returncode:
        return f"{venv} lacks lmcache, vLLM or kvtier: run `make peers` again"
    return None


class LMCache(System):
    """Two engines with `LMCacheMPConnector` and their `lmcache server`."""

    name = "lmcache"
    inproc = False

    def prepare(self) -> None:
        self.server = LMCacheServer(self.root, L1_BYTES)

    def start(self) -> None:
        self.start_engines({node: (self.server.transfer_config(), QUIET_ENV)
                            for node in ("a", "b")}, python=self.server.python)

    def stored(self) -> int:
        """The objects in the server's L1."""
        return self.server.stored()

    def close(self) -> None:
        super().close()
        if getattr(self, "server", None) is not None:
            self.server.stop()


class LMCacheServer:
    """One `lmcache server` (L1 of `l1_bytes`, LRU) from the peers' venv, started and
    answering; what its engines need: `transfer_config()`, `python`, `QUIET_ENV`.
    Raises `PeerUnavailable` (one line) when it cannot run here."""

    def __init__(self, root: Path, l1_bytes: int):
        venv = peers_dir() / "lmcache"
        problem = venv_problem(venv)
        if problem:
            raise PeerUnavailable(problem)
        self.python = str(venv / "bin" / "python")
        self.port, self.http_port = free_port(), free_port()
        log_path = root / "lmcache-server.log"
        command = [str(venv / "bin" / "lmcache"), "server", "--host", "127.0.0.1",
                   "--port", str(self.port), "--http-host", "127.0.0.1",
                   "--http-port", str(self.http_port), "--l1-size-gb", l1_size_arg(l1_bytes),
                   "--eviction-policy", "LRU", "--supported-transfer-mode", "auto"]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL,
                                         env={**os.environ, **QUIET_ENV},
                                         start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.status() is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise PeerUnavailable(f"the lmcache server did not start; see {log_path}")
            time.sleep(0.5)

    def transfer_config(self) -> dict:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": self.port}}

    def status(self) -> dict | None:
        try:
            url = f"http://127.0.0.1:{self.http_port}/status"
            with urllib.request.urlopen(url, timeout=2) as resp:
                return json.loads(resp.read())
        except OSError:
            return None

    def stored(self) -> int:
        status = self.status() or {}
        l1 = status.get("storage_manager", {}).get("l1_managers", {})
        return sum(m.get("total_object_count", 0) for m in l1.values())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
