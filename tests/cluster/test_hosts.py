"""kvtier across hosts: network namespaces made here, a master on one, nodes on the others.

Each host has its own address (198.18.0.0/15), loopback, index and nvme dir; one directory
is the shared filesystem; /dev/shm is the machine's, seen by every host. Every policy names
only the master's address (`local_hostname` unset). Teardown always runs, and the module ends
by checking that it left no namespace and no segment file behind.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import wait_until
from kvtier.tools.hosts import netns
from kvtier.tools.hosts.cluster import HostCluster, HostNode

why = netns.unavailable()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")

SIZE = 64 << 10  # payload bytes per block
DEADLINE_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("hosts")
    c = HostCluster(3, root)
    shm = Path("/dev/shm") / f"kvtier-hosts-{os.getpid()}"
    c.segment_dir = shm
    try:
        c.start_master(0)
        yield c
    finally:
        c.close()
        shutil.rmtree(shm, ignore_errors=True)
        assert not any((netns.NETNS_DIR / n).exists()
                       for n in [*c.hosts.names, c.hosts.bridge_ns]), "a namespace was left"


@pytest.fixture
def nodes(cluster):
    started: list[HostNode] = []

    def start(i: int, name: str | None = None, **policy) -> HostNode:
        path = cluster.write_policy(i, f"{name or f'host{i}'}.yaml", **policy)
        node = HostNode(cluster, i, name, path)
        started.append(node)
        return node
    yield start
    for node in started:
        node.close()


def test_each_host_announces_its_own_address_and_blocks_cross_hosts_byte_for_byte(
        cluster, nodes):
    a, b, c = nodes(0), nodes(1), nodes(2)  # host 0 also runs the master
    assert [a.announced, b.announced, c.announced] == cluster.hosts.addresses
    assert a.call("save", seed=1, n=12, size=SIZE)["saved"] == 12
    assert c.call("save", seed=2, n=12, size=SIZE)["saved"] == 12
    for reader, seed in ((b, 1), (c, 1), (a, 2), (b, 2)):
        got = reader.call("load", seed=seed, n=12, size=SIZE, deadline_s=10)
        assert got == {**got, "hits": 12, "loaded": 12, "wrong": 0, "late": 0}, got
        assert got["tiers"] == ["dram"]
    assert b.call("stats")["lender_failures"] == {}


def test_a_cut_off_lender_gives_misses_never_wrong_bytes_or_a_stuck_request(cluster, nodes):
    lender, reader = nodes(1, "lender1", tiers=("dram",)), nodes(2, "reader2", tiers=("dram",))
    assert lender.call("save", seed=3, n=8, size=SIZE)["saved"] == 8
    assert reader.call("load", seed=3, n=8, size=SIZE, deadline_s=10)["loaded"] == 8
    cluster.hosts.cut(1)
    try:
        # The master still lists the blocks: the first load waits for its deadline (what
        # recomputing would cost), reads nothing wrong, and marks the lender.
        first = reader.call("load", seed=3, n=8, size=SIZE, deadline_s=DEADLINE_S)
        assert first["wrong"] == 0 and first["loaded"] == 0
        assert first["ms"] < (DEADLINE_S + 2) * 1e3
        blocked = wait_until(lambda: reader.call("stats")["blocked"], 10, "the lender marked")
        assert [b.rsplit(":", 1)[0] for b in blocked] == [cluster.hosts.addresses[1]]
        # From then on the lender's blocks are misses: no request waits for them.
        for _ in range(3):
            got = reader.call("load", seed=3, n=8, size=SIZE, deadline_s=DEADLINE_S)
            assert got["hits"] == 0 and got["wrong"] == 0 and got["ms"] < 1000, got
        # The reader's own saves still work while another host is cut off, and do not
        # wait for the abandoned transfer (it holds its staging area until TCP gives up).
        t0 = time.monotonic()
        assert reader.call("save", seed=4, n=4, size=SIZE)["saved"] == 4
        assert time.monotonic() - t0 < DEADLINE_S
        assert reader.call("load", seed=4, n=4, size=SIZE)["loaded"] == 4
    finally:
        cluster.hosts.restore(1)
    # Back on the network: the lender's new saves are hits on the reader again.
    wait_until(lambda: lender.call("save", seed=5, n=4, size=SIZE)["saved"] == 4, 30,
               "the lender saving again after its link came back", every_s=1)
    wait_until(lambda: reader.call("load", seed=5, n=4, size=SIZE, deadline_s=5)["loaded"] == 4,
               60, "the reader loading the lender's blocks again", every_s=1)
    assert reader.call("load", seed=5, n=4, size=SIZE)["wrong"] == 0


def test_segment_files_are_read_in_place_only_on_their_own_host(cluster, nodes):
    seg = {"segment_dir": str(cluster.segment_dir)}
    lender = nodes(1, "files1", tiers=("dram",), **seg)
    same_host = nodes(1, "files1b", tiers=("dram",), **seg)
    other_host = nodes(2, "files2", tiers=("dram",), **seg)
    assert lender.call("save", seed=6, n=8, size=SIZE)["saved"] == 8
    # every host sees the lender's file in the one /dev/shm of the machine
    assert any(f".{cluster.hosts.addresses[1].rsplit('.', 1)[1]}_" in p.name
               for p in cluster.segment_dir.iterdir())
    host1, host2 = cluster.hosts.addresses[1], cluster.hosts.addresses[2]
    got = other_host.call("load", seed=6, n=8, size=SIZE, deadline_s=10)
    assert got["loaded"] == 8 and got["wrong"] == 0
    # through the transfer engine: of the files, it maps only its own host's (its own)
    assert other_host.call("stats")["mapped_hosts"] == [host2]
    got = same_host.call("load", seed=6, n=8, size=SIZE, deadline_s=10)
    assert got["loaded"] == 8 and got["wrong"] == 0
    stats = same_host.call("stats")  # straight out of the lender's file, mapped as it opened
    assert stats["mapped_hosts"] == [host1] and stats["mapped"] == 2  # the lender's, its own


def test_hosts_are_swept_when_their_owner_died(tmp_path):
    import subprocess
    import sys
    made = subprocess.run([sys.executable, "-c", (
        "from kvtier.tools.hosts.netns import Hosts\n"
        "import os\nh = Hosts(2)\nprint(' '.join([h.bridge_ns, *h.names]), flush=True)\n"
        "os._exit(0)")],
        capture_output=True, text=True, timeout=60)
    left = made.stdout.split()
    assert all((netns.NETNS_DIR / n).exists() for n in left)  # os._exit skipped the teardown
    assert set(left) <= set(netns.sweep())
    assert not any((netns.NETNS_DIR / n).exists() for n in left)


def test_ha_masters_on_two_hosts_elect_the_standby_and_keep_their_own_logs(tmp_path):
    """The soak times a leader kill by what etcd names (`HostCluster.leader`), and each
    master's own log is kept beside kvtier's lines (elections, warm-ups, restores)."""
    c = HostCluster(3, tmp_path)
    try:
        c.start_ha(leader=0, standby=1, etcd=2)
        assert c.leader() == c.ha_address(0)
        c.kill_ha_master(0)
        wait_until(lambda: c.leader() == c.ha_address(1), 30, "the standby's election")
        for i in (0, 1):  # mooncake_master's own output (glog's), not only kvtier's lines
            assert "InitGoogleLogging" in c.master_log(i).read_text(errors="replace")
    finally:
        c.close()


@pytest.mark.slow
def test_the_sim_replay_on_three_hosts_hits_as_on_one_and_counts_cross_host_hits(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvtier.tools.cli import app

    def run(hosts: int) -> dict:
        path = tmp_path / f"r{hosts}.json"
        res = CliRunner().invoke(app, [
            "replay", "--engine", "sim", "--instances", "3", "--hosts", str(hosts),
            "--sessions", "4", "--turns", "4", "--scale", "0.05", "--baselines", "",
            "--no-plots", "--out", str(tmp_path / f"out{hosts}"), "--json", str(path)],
            catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return json.loads(path.read_text())["runs"][0]["configs"]["kvtier"]

    before = {p.name for p in netns.NETNS_DIR.glob("kvt*")}
    one, three = run(1), run(3)
    split = three["pool_hits_by_host"]
    assert split["cross"] > 0 and split["same"] + split["cross"] > 0
    assert "pool_hits_by_host" not in one
    assert abs(three["overall"]["hit_rate"] - one["overall"]["hit_rate"]) <= 0.5
    assert three["overall"]["hit_by_tier"]["dram"] > 0
    assert {p.name for p in netns.NETNS_DIR.glob("kvt*")} <= before  # the replay's are gone


def test_a_host_cut_off_from_the_master_serves_from_its_own_tiers_without_waiting(cluster,
                                                                                 nodes):
    """Its pool lookups have no answer: bounded by `call_timeout_s` once, then failed at once
    while the master stays unreachable; its nvme and the shared dir still serve."""
    node = nodes(1, "alone1")
    assert node.call("save", seed=7, n=8, size=SIZE)["saved"] == 8
    assert node.call("flush")["pending"] == 0  # persisted below the pool
    cluster.hosts.cut(1)
    try:
        took = []
        for _ in range(4):
            t0 = time.monotonic()
            got = node.call("load", seed=7, n=8, size=SIZE, deadline_s=DEADLINE_S)
            took.append(time.monotonic() - t0)
            assert got["loaded"] == 8 and got["wrong"] == 0 and "dram" not in got["tiers"]
        assert took[0] < DEADLINE_S and max(took[1:]) < 0.5, took
        t0 = time.monotonic()
        assert node.call("save", seed=8, n=4, size=SIZE)["saved"] == 4  # below the pool
        assert time.monotonic() - t0 < DEADLINE_S
    finally:
        cluster.hosts.restore(1)
    wait_until(lambda: "dram" in node.call("lookup", seed=8, n=1)["tiers"]
               or node.call("save", seed=9, n=1, size=SIZE) and
               "dram" in node.call("lookup", seed=9, n=1)["tiers"], 30,
               "the pool serving the host again")


def test_blocks_persisted_on_one_host_read_on_another_over_glusterfs(tmp_path, monkeypatch):
    """A GlusterFS volume as it is deployed: a brick on every host, each host its own mount
    (its FUSE client in its own namespace). What one host persists, another reads over the
    bridge, every brick holds a replica, and with the writer's host cut off the reader still
    reads every block from the bricks left."""
    from kvtier.tools.hosts import glusterfs
    why_not = glusterfs.unavailable(hosts=True)
    if why_not:
        pytest.skip(why_not)
    monkeypatch.chdir(tmp_path)  # a relative root, as `--out replay-out` gives (glusterd
    # takes absolute paths only)
    with HostCluster(3, tmp_path / "c") as c, \
            glusterfs.GlusterVolume(Path("gluster"), c.hosts) as vol:
        assert len(set(vol.mounts)) == 3 and all(os.path.ismount(m) for m in vol.mounts)
        c.use_shared([m / "shared" for m in vol.mounts])
        c.start_master(0)
        writer = HostNode(c, 1, "w1", c.write_policy(1, "w1.yaml"))
        reader = HostNode(c, 2, "r2", c.write_policy(2, "r2.yaml", tiers=("shared",)))
        try:
            assert writer.call("save", seed=11, n=8, size=SIZE)["saved"] == 8
            assert writer.call("flush")["pending"] == 0
            got = reader.call("load", seed=11, n=8, size=SIZE, deadline_s=10)
            assert got == {**got, "hits": 8, "loaded": 8, "wrong": 0}, got
            assert got["tiers"] == ["shared"]
            for brick in vol.bricks:  # replicated on every host
                files = [p for p in (brick / "shared").rglob("*.kvb") if p.is_file()]
                assert len(files) >= 8, brick
            c.hosts.cut(1)
            try:
                got = reader.call("load", seed=11, n=8, size=SIZE, deadline_s=30)
                assert got == {**got, "hits": 8, "loaded": 8, "wrong": 0}, got
            finally:
                c.hosts.restore(1)
        finally:
            writer.close()
            reader.close()
    assert not any(os.path.ismount(m) for m in vol.mounts)
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit()
                and str(tmp_path / "gluster") in _cmdline(p)]


def test_a_lookup_on_a_host_cut_off_from_its_glusterfs_bricks_waits_a_timeout_not_the_mount(
        tmp_path, monkeypatch):
    """A host cut off from the other bricks: its FUSE mount stalls file operations for the
    volume's ping timeout and more (measured: a lookup held 19 s by one `stat` before the
    sharedfs tier bounded its lookups). The first lookup there gives up on the tier after
    `call_timeout_s` (1 s), the next ones skip it while that stat hangs."""
    from kvtier.tools.hosts import glusterfs
    why_not = glusterfs.unavailable(hosts=True)
    if why_not:
        pytest.skip(why_not)
    monkeypatch.chdir(tmp_path)  # glusterd takes absolute paths only: a relative root
    with HostCluster(3, tmp_path / "c") as c, \
            glusterfs.GlusterVolume(Path("gluster"), c.hosts) as vol:
        c.use_shared([m / "shared" for m in vol.mounts])
        c.start_master(0)
        node = HostNode(c, 1, "r1", c.write_policy(1, "r1.yaml", tiers=("shared",)))
        try:
            assert node.call("save", seed=11, n=8, size=SIZE)["saved"] == 8
            assert node.call("flush")["pending"] == 0
            assert node.call("lookup", seed=11, n=8)["hits"] == 8
            c.hosts.cut(1)
            try:
                took = []
                for seed in (100, 101, 102):  # cold chains: every lookup reaches the mount
                    t0 = time.monotonic()
                    assert node.call("lookup", seed=seed, n=64)["hits"] == 0
                    took.append(time.monotonic() - t0)
                assert took[0] < DEADLINE_S and max(took[1:]) < 0.5, took
            finally:
                c.hosts.restore(1)
        finally:
            node.close()


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
def test_a_short_soak_across_hosts_cuts_links_and_kills_hosts_and_serves_nothing_wrong(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvtier.tools.cli import app
    js = tmp_path / "soak.json"
    res = CliRunner().invoke(app, [
        "replay", "--engine", "sim", "--soak", "1", "--fault-every", "10",
        "--hosts", "2", "--instances", "2", "--sessions", "4", "--turns", "5",
        "--scale", "0.05", "--faults", "link-cut,host-kill,master-restart",
        "--out", str(tmp_path / "out"), "--json", str(js)], catch_exceptions=False)
    rep = json.loads(js.read_text())
    assert res.exit_code == 0 and rep["ok"], (rep["why_not"], res.output[-3000:])
    assert rep["wrong_blocks"] == 0 and rep["requests"]["failed"] == 0
    assert rep["check"]["clean"]
    for kind in ("link-cut", "host-kill", "master-restart"):
        assert rep["by_fault"][kind]["injected"] >= 1, kind
        assert rep["by_fault"][kind]["failed"] == 0 and rep["by_fault"][kind]["wrong"] == 0
    assert rep["instance_deaths"].get("host killed", 0) >= 1
    # the pool served again after the host's instances came back
    assert rep["by_fault"]["host-kill"]["recovery_s"] or \
        rep["by_fault"]["host-kill"]["unrecovered_s"] == []


def test_a_short_soak_with_the_shared_filesystem_on_glusterfs_serves_nothing_wrong(tmp_path):
    """The soak across two hosts with the sharedfs tier on a GlusterFS volume that has a
    brick and a mount on every host: a host's link cut (its mount loses the other bricks),
    a host killed (its brick and mount with it, brought back with its instances) and a
    corrupted block file on the volume; nothing wrong is served, no request fails."""
    import json

    from typer.testing import CliRunner

    from kvtier.tools.cli import app
    from kvtier.tools.hosts import glusterfs
    why_not = glusterfs.unavailable(hosts=True)
    if why_not:
        pytest.skip(why_not)
    js = tmp_path / "soak.json"
    res = CliRunner().invoke(app, [
        "replay", "--engine", "sim", "--soak", "0.75", "--fault-every", "10",
        "--hosts", "2", "--shared-fs", "glusterfs", "--instances", "2", "--sessions", "4",
        "--turns", "5", "--scale", "0.05", "--faults", "link-cut,host-kill,corrupt-file",
        "--out", str(tmp_path / "out"), "--json", str(js)], catch_exceptions=False)
    rep = json.loads(js.read_text())
    assert res.exit_code == 0, res.output[-3000:]
    assert rep["wrong_blocks"] == 0 and rep["requests"]["failed"] == 0, rep["why_not"]
    assert rep["check"]["clean"], rep["check"]
    for kind in ("link-cut", "host-kill", "corrupt-file"):
        assert rep["by_fault"][kind]["injected"] >= 1, kind
    volume = tmp_path / "out" / "work" / "soak" / "hosts" / "glusterfs"
    bricks = sorted(volume.glob("h*/brick"))
    assert len(bricks) == 3  # a brick on each host and the master's
    for brick in bricks:  # the shared tier's files, replicated on every brick
        assert any((brick / "shared").rglob("*.kvb")), brick
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit()
                and str(volume) in _cmdline(p)]
