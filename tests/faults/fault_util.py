"""Shared pieces of the fault suite: deterministic blocks, small policies, child processes,
tmpfs mounts and socket listings.

Everything a child process needs travels as JSON (policies as plain dicts), so the writer
processes (`store_writer.py`) rebuild exactly what the parent checks against. Payloads are a
pure function of the key: any byte served anywhere can be checked without remembering it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.store.base import block
from kvtier.store.base.config import Policy, policy_from_dict
from kvtier.store.base.keys import Namespace, id_chain_hashes, make_keys
from kvtier.tiers import MISS

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
KiB, MiB = 1024, 1024 * 1024
NS = Namespace(model="kvtier-faults", chunk_tokens=16)
OTHER_NS = Namespace(model="kvtier-faults-other", chunk_tokens=16)


# ---- blocks ------------------------------------------------------------------------------

def request_keys(request_id: str, n: int, ns: Namespace = NS) -> list[str]:
    """The chained keys of a request of `n` chunks (a prefix chain, as the connector makes)."""
    return make_keys(ns.fingerprint(), id_chain_hashes(range(n), salt=request_id.encode()))


def payload_for(key: str, size: int) -> bytes:
    return np.random.default_rng(int(key[-15:], 16)).bytes(size)


def frame_for(key: str, size: int) -> memoryview:
    buf = block.alloc_aligned(block.HEADER_SIZE + size)
    buf[block.HEADER_SIZE:block.HEADER_SIZE + size] = payload_for(key, size)
    block.seal(buf, key, size)
    return buf


def out_for(size: int) -> memoryview:
    return block.alloc_aligned(block.HEADER_SIZE + size)


def load_checked(store, keys: list[str], size: int) -> tuple[list[bool], list[str]]:
    """Load `keys` through `store`: (hit per key, keys served with wrong bytes)."""
    outs = [out_for(size) for _ in keys]
    got = store.load(keys, outs)
    wrong = [k for k, o, n in zip(keys, outs, got) if n != MISS and (
        n != size or bytes(o[block.HEADER_SIZE:block.HEADER_SIZE + n]) != payload_for(k, size))]
    return [n != MISS for n in got], wrong


# ---- policies ----------------------------------------------------------------------------

def policy_dict(root: Path, master_address: str | None = None, *, nvme: Path | None = None,
                shared: Path | None = None, nvme_capacity: str = "64MiB",
                shared_capacity: str = "128MiB", **over) -> dict:
    """A small policy as plain data: dram (when a master is given), nvme and sharedfs."""
    tiers = []
    if master_address:
        tiers.append({"name": "dram", "kind": "mooncake", "capacity": "32MiB",
                      "buffer": "16MiB", "staging": "16MiB", "retry_backoff_s": 0.01})
    tiers += [{"name": "nvme", "kind": "nvme", "path": str(nvme or root / "nvme"),
               "capacity": nvme_capacity, "region_size": "1MiB"},
              {"name": "shared", "kind": "sharedfs", "path": str(shared or root / "shared"),
               "capacity": shared_capacity}]
    data = {"namespace": {"model": NS.model}, "chunk_tokens": NS.chunk_tokens,
            "index": {"path": str(root / "index"), "map_size": "64MiB"},
            "master": {"address": master_address or "127.0.0.1:1", "embedded": False},
            "mover": {"interval_s": 0.05, "buffer": "16MiB"},
            "admission": {"kind": "always"}, "tiers": tiers}
    data.update(over)
    return data


def make(data: dict) -> Policy:
    return policy_from_dict(json.loads(json.dumps(data)), source="<fault policy>")


def without_pool(data: dict) -> dict:
    """The same node without its dram tier: the pool keeps no index state of the node, so
    offline checks and verification reads skip it (and the ~2 s Mooncake client close)."""
    return {**data, "tiers": [t for t in data["tiers"] if t["kind"] != "mooncake"]}


# ---- child processes ---------------------------------------------------------------------

class Child:
    """A Python child running one of this folder's scripts, speaking JSON lines on stdout."""

    def __init__(self, script: str, job: dict, env: dict | None = None, log: Path | None = None):
        self.log_path = log
        self.log = open(log, "ab") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / script), json.dumps(job)], stdout=subprocess.PIPE,
            stdin=subprocess.PIPE, stderr=self.log, env={**os.environ, **(env or {})},
            cwd=str(TESTS))
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self, timeout_s: float = 60.0) -> dict | None:
        """The next JSON line, or None at end of output; fails after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"child {self.pid} said nothing for {timeout_s:.0f}s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def expect(self, timeout_s: float = 60.0) -> dict:
        """The next JSON line; the child ending instead is a failure showing its log."""
        msg = self.read(timeout_s)
        if msg is None:
            raise AssertionError(f"child {self.pid} ended early{self.log_tail()}")
        return msg

    def log_tail(self, lines: int = 15) -> str:
        if not self.log_path:
            return ""
        text = Path(self.log_path).read_text(errors="replace").splitlines()
        ours = [ln for ln in text if not ln[:1] in "IWE" or not ln[1:2].isdigit()]  # no glog
        return "\n--- child log ---\n" + "\n".join(ours[-lines:])

    def kill(self) -> None:
        """SIGKILL this child (only ever our own pid) and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def finish(self, timeout_s: float = 120.0) -> list[dict]:
        """Every remaining line, after a clean exit."""
        lines = []
        while (msg := self.read(timeout_s)) is not None:
            lines.append(msg)
        assert self.proc.wait(timeout_s) == 0, f"child exited with {self.proc.returncode}"
        return lines

    def release(self) -> None:
        """Let a holding child go on (closes its stdin)."""
        if not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self) -> None:
        self.kill()
        self.release()
        self.proc.stdout.close()
        if self.log is not subprocess.DEVNULL:
            self.log.close()




# ---- a node's store ----------------------------------------------------------------------

@pytest.fixture
def store(tmp_path, shared_master):
    """A `TieredStore` of node `node-a` (pool, nvme, sharedfs under tmp_path), no mover
    thread; closed after the test."""
    from kvtier.store.tiered import TieredStore
    s = TieredStore(make(policy_dict(tmp_path, shared_master.address)), node_id="node-a",
                    mover=False)
    yield s
    s.close()


# ---- mounts and sockets ------------------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(name, size) -> a fresh tmpfs directory, unmounted after the test."""
    mounted: list[Path] = []

    def mount(name: str, size: str = "8m") -> Path:
        where = tmp_path / name
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                               str(where)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False)


def listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (from `ss -ltnp`)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        local = line.split()[3]
        host, port = local.rsplit(":", 1)
        found.append((host.strip("[]"), int(port)))
    return found
