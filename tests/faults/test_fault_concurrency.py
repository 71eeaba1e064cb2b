"""Concurrency: four processes writing and reading one node's tiers and index at once (two as
node `a`, two as node `b`, sessions inferred by the store, half their requests shared by all),
while `kvtier inspect`, `inspect check` and `inspect gc` run beside them from the CLI.

The nvme tier is first and small (8 regions), so the writers reclaim regions under each
other all the time. Checked:
- no writer ever reads wrong bytes, and no tier counts a corrupt frame (a region handed to
  two writers, or reclaimed twice, would overwrite live frames);
- READY nvme entries of live generations never overlap; nothing is left PENDING;
- every session each writer stored is in the index (no lost update of the manifests);
- every `inspect check` during the run and after it is clean; `gc` removes nothing live;
- after the run every READY entry reads back with its exact bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fault_util import KiB, Child, load_checked, make, policy_dict, request_keys
from kvtier.store.base.index import Index
from kvtier.store.base.index_record import READY
from kvtier.store.check.node import check_node
from kvtier.store.sessions.persist import read_sessions
from kvtier.store.tiered import TieredStore
from kvtier.tiers.nvme.region_rows import unpack_loc

SIZE = 64 * KiB
BLOCKS = 4
WRITERS = (("a", 0), ("a", 1), ("b", 2), ("b", 3))


def cli(policy_file: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "inspect", *args,
                          "--policy", str(policy_file), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return json.loads(out.stdout)


def start_writers(data: dict, tmp_path: Path) -> list[Child]:
    return [Child("store_writer.py", {"policy": data, "node": f"node-{node}", "infer": True,
                                      "first": 10**6 * w, "oldest": 10**6 * w,
                                      "until_released": True,
                                      "common": 8, "size": SIZE, "blocks": BLOCKS,
                                      "reread": 1, "seed": w},
                  log=tmp_path / f"writer-{w}.log") for node, w in WRITERS]


def assert_no_overlap(policy) -> None:
    ix = Index(policy.index.path, readonly=True, recover=False)
    try:
        spans: dict[tuple, list] = {}
        for e in ix.scan("nvme", states=(READY,)):
            spans.setdefault(unpack_loc(e.loc_a), []).append((e.loc_b, e.loc_b + e.size, e.key))
    finally:
        ix.close()
    for where, s in spans.items():
        s.sort()
        for (a0, a1, ka), (b0, b1, kb) in zip(s, s[1:]):
            assert a1 <= b0, f"region {where}: {ka} and {kb} overlap"


def run_beside(writers: list[Child], policy_file: Path, rounds: int) -> tuple[list, dict]:
    """`rounds` of inspect, check and gc while every writer is busy; then let them finish."""
    for w in writers:
        assert "ready" in w.expect(90)
        assert "saved" in w.expect(60)  # writing, not only started
    checks = []
    for _ in range(rounds):
        cli(policy_file)
        checks.append(cli(policy_file, "check"))
        gc = cli(policy_file, "gc")
        assert gc["unreferenced"] == 0 and gc["pending"] == 0, gc  # nothing live is old
        assert all(w.proc.poll() is None for w in writers), "a writer died"
    for w in writers:
        w.release()
    return checks, {i: w.finish(120) for i, w in enumerate(writers)}


@pytest.mark.parametrize("rounds", [pytest.param(3, id="ci"),
                                    pytest.param(20, id="long", marks=pytest.mark.slow)])
def test_four_writers_beside_inspect_check_and_gc(tmp_path, rounds):
    data = policy_dict(tmp_path, None, nvme_capacity="8MiB", shared_capacity="64MiB")
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(data))
    writers = start_writers(data, tmp_path)
    try:
        checks, results = run_beside(writers, policy_file, rounds)
    finally:
        for w in writers:
            w.close()
    msgs = [m for lines in results.values() for m in lines]
    assert not [m for m in msgs if m.get("wrong")], "a writer read wrong bytes"
    done = [m for m in msgs if "done" in m]
    assert len(done) == len(WRITERS)
    assert all(c["corrupt"] == 0 for m in done for c in m["counters"].values()), done
    policy = make(data)
    assert_no_overlap(policy)
    report = check_node(policy)  # after the run first: a lasting fault, or one of the check?
    assert report.clean, report.to_dict()
    bad = [c for c in checks if not c["clean"]]
    assert not bad, json.dumps({k: bad[0][k] for k in ("problems", "unchecked", "skipped")})
    ix = Index(policy.index.path, readonly=True, recover=False)
    try:
        assert ix.pending_count() == 0
        stored = {sid for sid, _, _ in read_sessions(ix)}
        ready = {(e.key, e.tier) for e in ix.scan(states=(READY,))}
    finally:
        ix.close()
    # writers that saw a session's first request call it the same; the union is stored
    live = {sid for m in done for sid in m["sessions"]}
    assert live <= stored, f"session manifests were lost: {sorted(live - stored)[:5]}"
    with TieredStore(policy, node_id="verifier", mover=False) as store:
        for tier in ("nvme", "shared"):
            keys = sorted(k for k, t in ready if t == tier)
            hits, wrong = load_checked(store, keys, SIZE)
            assert wrong == [] and all(hits), tier
    print(f"{len(checks)} inspect/check/gc rounds beside {len(WRITERS)} writers; "
          f"{len(ready)} READY copies, {len(stored)} sessions stored")


def test_a_key_allocated_twice_in_one_generation_is_dropped_at_reclaim(tmp_path):
    """Two threads of one process put the same key: both allocate in the process's region,
    one reservation wins. When the region is reclaimed, the winner's entry must go too
    (it stayed behind, READY and dead, when the loser's offset came last)."""
    from kvtier.store.base.index_record import Entry
    from kvtier.tiers.nvme.region_rows import pack_loc
    from fault_util import frame_for
    data = policy_dict(tmp_path, None, nvme_capacity="2MiB")
    with TieredStore(make(data), node_id="n", mover=False) as store:
        nvme = store.by_name["nvme"]
        key = request_keys("twice", 1)[0]
        (slot, gen, first), (_, _, second) = nvme.regions.allocate([4096, 4096], [key, key]).locs
        assert second > first
        e = Entry(key, "nvme", size=4096, loc_a=pack_loc(slot, gen), loc_b=first)
        assert store.index.reserve([e]) == [True]  # the winner holds the first offset
        store.index.commit("nvme", [key])
        others = request_keys("filler", 40)
        for k in others:  # 40 x 64 KiB through 2 x 1 MiB regions: both are reclaimed
            nvme.put([k], [frame_for(k, SIZE)])
        assert nvme.regions.generations({slot})[slot] > gen
        assert store.index.get("nvme", [key], ready_only=False) == [None]
