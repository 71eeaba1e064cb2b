"""`kvtier replay --engine sim --soak`: the replay under faults, and the checks that judge it.

The short soak cycles through every fault (an instance SIGKILLed mid-save and restarted,
the master killed and restarted, the disk filled to ENOSPC, stored frames corrupted) and must
come out clean: no wrong block, no failed request, `inspect check` clean. The other tests
show that the judge can fail: a frame carrying another key is a wrong block, and a soak
that served one is not ok.
"""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from kvtier.store.base import block
from kvtier.store.base.errors import CorruptBlockError
from kvtier.store.base.keys import id_chain_hashes, make_keys
from kvtier.tools.cli import app
from kvtier.tools.replay.sim_worker import _Instance
from kvtier.tools.replay.soak.faults import Balloon, SoakDisk, corrupt_block_file, corrupt_frame
from kvtier.tools.replay.soak.injector import FAULTS, Injector
from kvtier.tools.replay.soak.report import verdict

PAYLOAD = 4096


def keys(n: int, salt: str = "soak") -> list[str]:
    return make_keys("ab" * 8, id_chain_hashes(range(n), salt=salt.encode()))


def test_short_soak_cycles_every_fault_and_serves_nothing_wrong(tmp_path):
    out, js = tmp_path / "out", tmp_path / "soak.json"
    res = CliRunner().invoke(app, [
        "replay", "--engine", "sim", "--soak", "0.4", "--fault-every", "5",
        "--instances", "2", "--sessions", "4", "--turns", "5", "--scale", "0.05",
        "--out", str(out), "--json", str(js)], catch_exceptions=False)
    rep = json.loads(js.read_text())
    assert res.exit_code == 0 and rep["ok"], (rep["why_not"], res.output[-3000:])
    assert (out / "replay-soak.json").exists()
    assert rep["wrong_blocks"] == 0 and rep["requests"]["failed"] == 0
    assert rep["requests"]["completed"] > 0 and rep["repetitions"] >= 1
    assert rep["check"]["clean"] and rep["check"]["problems_by_kind"] == {}
    for kind in FAULTS:
        c = rep["faults"][kind]
        if kind == "disk-full" and not rep["tmpfs"]:
            assert c["skipped"] >= 1  # without root: said so, not silently left out
        else:
            assert c["injected"] >= 1, kind
    # the planned kill cut a save, which was retried on the restarted instance
    assert rep["instance_deaths"].get("killed mid-call", 0) + \
        rep["instance_deaths"].get("killed between calls", 0) >= 1
    assert set(rep["instance_deaths"]) <= {"killed mid-call", "killed between calls"}
    assert rep["requests"]["retried"] == rep["instance_deaths"].get("killed mid-call", 0)
    # the pool served hits again after the master came back, and that was measured
    assert rep["master"]["recovery_s"] and rep["master"]["max_s"] < rep["master"]["bound_s"]
    # what was corrupted and read (by the workload or the read-back) was caught
    caught = sum(rep["corrupt_detected"].values())
    read_back = sum(c.get("corrupt", 0) for c in rep["read_back"].values())
    assert rep["corrupted"]["shared"] + rep["corrupted"]["nvme"] >= 1
    assert caught >= read_back
    assert [iv["interval"] for iv in rep["intervals"]] == list(range(len(rep["intervals"])))
    assert "inspect check at the end" in res.output


def _instance(tmp_path) -> _Instance:
    """One simulated instance in this process, without the pool (no master needed)."""
    policy = {"namespace": {"model": "soak-test"}, "chunk_tokens": 32,
              "index": {"path": str(tmp_path / "index"), "map_size": "64MiB"},
              "master": {"address": "127.0.0.1:1", "embedded": False},
              "admission": {"kind": "always"},
              "tiers": [{"name": "nvme", "kind": "nvme", "path": str(tmp_path / "nvme"),
                         "capacity": "64MiB", "region_size": "4MiB"},
                        {"name": "shared", "kind": "sharedfs",
                         "path": str(tmp_path / "shared"), "capacity": "64MiB"}]}
    return _Instance(policy, "n0", PAYLOAD)


def test_a_frame_that_carries_another_key_is_a_wrong_block(tmp_path):
    inst = _instance(tmp_path)
    try:
        good, bad, other = keys(3)
        inst.save([good], [good], None, 1.0)  # the worker writes the key into the payload
        frame = block.alloc_aligned(block.HEADER_SIZE + PAYLOAD)
        frame[block.HEADER_SIZE:block.HEADER_SIZE + len(other)] = other.encode()
        block.seal(frame, bad, PAYLOAD)  # sound for `bad`, but it holds `other`'s bytes
        inst.store.save([bad], [frame])
        inst.store.mover.step()
        assert inst.request([good], 0, None, 2.0)[::3] == (1, 0)
        hit, tiers, _, wrong = inst.request([good, bad], 0, None, 3.0)
        assert (hit, len(tiers), wrong) == (1, 1, 1)  # counted, and the hit ends before it
        assert inst.scrub("shared", [good, bad]) == {"held": 2, "corrupt": 0, "wrong": 1}
    finally:
        inst.store.close()
    assert verdict(_report(wrong=1), 30.0) == ["1 wrong blocks served"]
    assert verdict(_report(), 30.0) == []


def _report(wrong: int = 0) -> dict:
    return {"wrong_blocks": wrong, "requests": {"failed": 0, "completed": 5},
            "check": {"clean": True, "problems_by_kind": {}},
            "master": {"recovery_s": [1.0], "unrecovered_s": []}}


def test_the_verdict_fails_on_failures_an_unclean_check_and_a_slow_recovery():
    r = _report()
    r["requests"]["failed"] = 2
    r["check"] = {"clean": False, "problems_by_kind": {"pending": 1}}
    r["master"] = {"recovery_s": [40.0], "unrecovered_s": [31.0]}
    why = verdict(r, 30.0)
    assert why[0] == "2 failed requests" and "pending" in why[1] and "2 times" in why[2]


def test_corruptions_break_verification(tmp_path):
    rng = random.Random(1)
    k = keys(1)[0]
    root = tmp_path / "shared" / "ab" / "cd"
    root.mkdir(parents=True)
    for n in range(6):  # flips and truncations
        path = root / f"{k}.kvb"
        path.write_bytes(bytes(block.encode(k, bytes(range(256)) * 16)))
        key, what = corrupt_block_file(tmp_path / "shared", rng)
        assert key == k, what
        with pytest.raises(CorruptBlockError):
            block.verify(path.read_bytes(), k)
    data = tmp_path / "regions.kvr"
    data.write_bytes(b"\0" * 8192 + bytes(block.encode(k, b"x" * 4000)))
    corrupt_frame(str(data), 8192, 4064, rng)
    with pytest.raises(CorruptBlockError):
        block.verify(data.read_bytes()[8192:], k)


def test_disk_full_is_skipped_and_said_so_without_root(tmp_path, monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    disk = SoakDisk(tmp_path / "disk", 1 << 20)
    assert not disk.mounted and "not root" in disk.skipped
    said = []
    inj = Injector(1.0, None, [], disk, tmp_path, random.Random(0), said.append,
                   faults=("disk-full",))
    inj.tick(1.0)
    assert inj.counts["disk-full"] == {"injected": 0, "skipped": 1}
    assert inj.log[0]["skipped"] and "not root" in said[0]
    assert not Balloon(disk.where).inflated
