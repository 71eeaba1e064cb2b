"""Shared fixtures: a real mooncake_master on 127.0.0.1, temporary kvtier homes, policies.

Every server binds loopback on a free port; every fixture stops what it starts.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import pytest

from kvtier.store.base.config import MasterConfig, policy_from_dict
from kvtier.store.base.errors import TierUnavailableError
from kvtier.tiers.mooncake.master import EmbeddedMaster
from kvtier.tools.api_server import metric_sum  # noqa: F401  (the tests' helper too)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="run the long variants too")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="long variant: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _vllm_ipc_dir(tmp_path_factory):
    """vLLM makes its IPC sockets in `VLLM_RPC_BASE_PATH` (default: the temp dir), and a run
    of the suite left 14-16 behind there: keep them under the run's own temp dir (its path
    stays short: a socket path has at most 107 bytes)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("ipc")
        mp.setenv("VLLM_RPC_BASE_PATH", str(path))
        yield path


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Each test gets its own KVTIER_HOME, so no test touches ~/.cache/kvtier."""
    home = tmp_path / "kvtier-home"
    monkeypatch.setenv("KVTIER_HOME", str(home))
    return home


_MASTER_LOGS = itertools.count()


def start_master(tmp_path: Path, **cfg) -> EmbeddedMaster:
    """A master on free loopback ports it picks itself (a port taken between pick and bind
    is picked again); its log is `master-<pid>-<n>.log` under `tmp_path`."""
    log = tmp_path / f"master-{os.getpid()}-{next(_MASTER_LOGS)}.log"
    master = EmbeddedMaster(MasterConfig(address="127.0.0.1:0", **cfg), log_path=log)
    return master.start()


@pytest.fixture
def mooncake_master(tmp_path):
    """A fresh mooncake_master on a free loopback port, stopped after the test."""
    master = start_master(tmp_path)
    yield master
    master.stop()


@pytest.fixture(scope="module")
def shared_master(tmp_path_factory):
    """One master for a whole test module (cheaper when tests do not restart it)."""
    master = start_master(tmp_path_factory.mktemp("master"))
    yield master
    master.stop()


def make_policy(root: Path, master_address: str = "127.0.0.1:1", **overrides):
    """A small three-tier policy under `root` (tests override what they need)."""
    data = {
        "chunk_tokens": 16,
        "index": {"path": str(root / "index"), "map_size": "64MiB"},
        "master": {"address": master_address, "embedded": False},
        "tiers": [
            {"name": "dram", "kind": "mooncake", "capacity": "64MiB", "buffer": "32MiB",
             "staging": "32MiB"},
            {"name": "nvme", "kind": "nvme", "path": str(root / "nvme"), "capacity": "64MiB",
             "region_size": "4MiB"},
            {"name": "shared", "kind": "sharedfs", "path": str(root / "shared"),
             "capacity": "128MiB"},
        ],
    }
    data.update(overrides)
    return policy_from_dict(data, source="<test policy>")


@pytest.fixture
def policy_factory(tmp_path):
    return lambda **kw: make_policy(tmp_path, **kw)


def wait_until(predicate, timeout_s: float, what: str, every_s: float = 0.05):
    """Poll `predicate` until it returns something truthy; return it, or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def matched(sched, request, computed: int = 0, timeout_s: float = 30.0):
    """The connector's `get_num_new_matched_tokens`, asked as vLLM asks it: again a step
    later while it answers None (the lookup still runs off the scheduler's thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = sched.get_num_new_matched_tokens(request, computed)
        if got[0] is not None:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"no lookup answer in {timeout_s:.0f}s")
        time.sleep(0.002)


def answered(call, timeout_s: float = 30.0, held=None):
    """What `call` returns once the tier answers it again (after a reconnect in the
    background); every call before that must fail at once, not wait for the reconnect.
    `held(t0, t1)`: seconds of a call the whole process was held (not counted as waiting)."""
    slowest = 0.0

    def attempt():
        nonlocal slowest
        t0 = time.monotonic()
        try:
            return call()
        except TierUnavailableError:
            return None
        finally:
            t1 = time.monotonic()
            slowest = max(slowest, t1 - t0 - (held(t0, t1) if held else 0.0))

    got = wait_until(attempt, timeout_s, "the tier to answer again")
    # a reconnect in the caller's path took >= 0.3 s (setup) + ~2 s (the old client's close)
    assert slowest < 0.5, f"a call waited {slowest:.2f}s while the client reconnected"
    return got


def venv_python() -> str:
    """The interpreter running the tests, for child processes."""
    import sys
    return sys.executable


os.environ.setdefault("GLOG_minloglevel", "2")  # keep Mooncake's glog chatter out of test logs
