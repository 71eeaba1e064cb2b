"""`kvtier inspect` on a real store (real master, LMDB, files): `check` finds each kind of
planted inconsistency and changes nothing, `--fix` leaves a store that checks clean with every
good block still readable, `gc`, the summary, `sessions` and `blocks`, and all of it beside a
live instance that keeps writing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import yaml
from typer.testing import CliRunner

from inspect_util import (NS, PAYLOAD, aged, dead_pid, drop_region_row, fill, flip_byte,
                          frames_for, index_state, kill_pending_writer, nvme_offset,
                          policy_data, readable,
                          rewrite_entry, session_keys, shared_file, start_worker, tree_state,
                          wait_line, write_policy)
from kvtier.store.base import block
from kvtier.store.base.config import load_policy
from kvtier.store.base.errors import IndexError_
from kvtier.store.base.index import Index
from kvtier.store.base.index_record import Entry
from kvtier.store.base.keys import block_keys
from kvtier.store.check.node import check_node, gc_node
from kvtier.store.sessions.persist import read_sessions, write_sessions
from kvtier.store.tiered import SessionHint, TieredStore
from kvtier.tiers.files import check as check_files
from kvtier.tiers.nvme.regions import pack_loc, unpack_loc
from kvtier.tiers.sharedfs.files import QUARANTINE, write_block
from kvtier.tools.cli import app

runner = CliRunner()


def kvtier(*args: str) -> subprocess.CompletedProcess:
    """The installed command line, in its own process."""
    return subprocess.run([sys.executable, "-m", "kvtier.tools.cli", *args],
                          capture_output=True, text=True, timeout=120)


def cli(*args: str):
    result = runner.invoke(app, ["inspect", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.output
    return result


def found(problems) -> set:
    return {(p["kind"] if isinstance(p, dict) else p.kind,
             p["tier"] if isinstance(p, dict) else p.tier,
             (p["key"] or p["path"]) if isinstance(p, dict) else (p.key or p.path))
            for p in problems}


def plant_everything(root, pol, keys: list[str]) -> set:
    """Plant one of each kind (and things that are fine); return what check must find."""
    ix = Index(pol.index.path, recover=False)
    try:
        want = plant_nvme(root, ix, keys) | plant_shared(root, ix, keys)
    finally:
        ix.close()
    dead = _key(8)
    kill_pending_writer(pol.index.path, "shared", dead)
    return want | {("pending", "shared", dead)}


def plant_nvme(root, ix: Index, keys: list[str]) -> set:
    flip_byte(root / "nvme" / "regions.kvr", nvme_offset(ix, keys[0]) + 1000)
    rewrite_entry(ix, "nvme", keys[1], checksum=12345)
    size = rewrite_entry(ix, "nvme", keys[2]).size
    rewrite_entry(ix, "nvme", keys[2], size=size + 4096)  # the counters still say `size`
    slot, gen = unpack_loc(ix.get("nvme", [keys[3]])[0].loc_a)
    rewrite_entry(ix, "nvme", keys[3], loc_a=pack_loc(slot, gen + 3))
    drop_region_row(ix, keys[4])
    orphan = root / "nvme" / "junk.bin"
    orphan.write_bytes(b"x" * 100)
    probe = aged(_touch(root / "nvme" / ".kvtier-probe-1"), 7200)
    return {("corrupt", "nvme", keys[0]), ("checksum", "nvme", keys[1]),
            ("size", "nvme", keys[2]), ("stats", "nvme", None), ("missing", "nvme", keys[3]),
            ("region", "nvme", keys[4]), ("orphan", "nvme", str(orphan)),
            ("stale_temp", "nvme", str(probe))}


def plant_shared(root, ix: Index, keys: list[str]) -> set:
    rewrite_entry(ix, "shared", keys[8], checksum=777)
    shared_file(root, keys[6]).unlink()
    truncated = shared_file(root, keys[7])
    truncated.write_bytes(truncated.read_bytes()[:1000])
    link = shared_file(root, keys[9])
    link.unlink()
    link.symlink_to("/etc/hostname")
    d, host = shared_file(root, keys[10]).parent, socket.gethostname()
    aged(_touch(d / f".{keys[10]}.kvb.other-node.123.ab12cd34.tmp"), 7200)
    _touch(d / f".{keys[11]}.kvb.{host}.{dead_pid()}.ab.tmp")
    _touch(d / f".{keys[12]}.kvb.{host}.{os.getpid()}.ab.tmp")  # a write in flight: fine
    notes = _touch(root / "shared" / "notes.txt")
    (root / "shared" / "ff").symlink_to(root)
    subdir = d / "not-a-block"
    subdir.mkdir()
    _write_frame(shared_file(root, _key(7)))  # another node's block: fine
    (root / "shared" / QUARANTINE).mkdir(exist_ok=True)
    _touch(root / "shared" / QUARANTINE / f"{keys[13]}.node.1.kvb")  # set aside: fine
    return {("gone", "shared", keys[6]), ("corrupt", "shared", keys[7]),
            ("checksum", "shared", keys[8]), ("orphan", "shared", keys[9]),
            ("missing", "shared", keys[9]), ("stale_temp", "shared", keys[10]),
            ("stale_temp", "shared", keys[11]), ("orphan", "shared", str(notes)),
            ("orphan", "shared", str(root / "shared" / "ff")),
            ("orphan", "shared", str(subdir))}


def _key(i: int) -> str:
    """A key no session of the tests uses (theirs start at multiples of 100,000 tokens)."""
    start = i * 1_000_000 + 50_000
    return block_keys(NS, range(start, start + 16))[0]


def _touch(path):
    path.write_bytes(b"partial")
    return path


def _write_frame(path):
    """A sound block file, as another node writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = frames_for([path.name[:-len(".kvb")]])[0]
    write_block(path, memoryview(frame)[:block.HEADER_SIZE + PAYLOAD], 0o600, False, "other.1")


def _state(pol, root) -> tuple:
    """The index's rows and the tiers' files (LMDB allows one open handle per process, so
    this one is closed before anything else opens the index)."""
    ix = Index(pol.index.path, recover=False)
    try:
        return index_state(ix), tree_state(root / "nvme"), tree_state(root / "shared")
    finally:
        ix.close()


def test_check_finds_every_planted_kind_and_fix_leaves_a_clean_store(tmp_path, shared_master,
                                                                      monkeypatch):
    monkeypatch.setattr(check_files, "PAGE_ENTRIES", 5)  # entries checked over many pages
    path, pol = write_policy(tmp_path, shared_master.address)
    sessions = session_keys(2, 8)
    fill(pol, sessions)
    keys = [k for ks in sessions.values() for k in ks]
    want = plant_everything(tmp_path, pol, keys)
    before = _state(pol, tmp_path)
    report = check_node(pol)
    assert found(report.problems) == want
    assert "no blocks of the pool" in report.skipped["dram"]
    # read-only: not a row of the index, not a file changed (the dead writer's entry stays)
    assert _state(pol, tmp_path) == before

    out = cli("check", "--json", "-p", str(path))
    assert out.exit_code == 1
    assert found(json.loads(out.stdout)["problems"]) == want
    # Under another node id the dead writer's young temp is not this node's to judge.
    out = cli("check", "--json", "--node-id", "elsewhere", "-p", str(path))
    assert found(json.loads(out.stdout)["problems"]) == want - {("stale_temp", "shared",
                                                                 keys[11])}
    fixed = cli("check", "--fix", "--json", "-p", str(path))
    assert fixed.exit_code == 0, fixed.stdout
    data = json.loads(fixed.stdout)
    assert data["clean"] and data["fixed"] >= len(want) - 1  # a link is one fix, two problems
    again = cli("check", "-p", str(path))
    assert again.exit_code == 0 and "clean" in again.stdout

    bad_nvme, bad_shared = set(keys[:5]), {keys[6], keys[7], keys[9]}
    assert readable(pol, "nvme", keys) == [k not in bad_nvme for k in keys]
    assert readable(pol, "shared", keys) == [k not in bad_shared for k in keys]
    assert len(list((tmp_path / "shared" / QUARANTINE).iterdir())) == 2  # + the truncated one
    ix = Index(pol.index.path, recover=False)
    e = ix.get("shared", [keys[8]])[0]  # the wrong entry was replaced by the file's truth
    assert e is not None and e.checksum != 777
    assert ix.get("nvme", keys[:5]) == [None] * 5
    ix.close()


def test_a_shared_file_another_node_evicted_leaves_the_check_clean(tmp_path, shared_master):
    path, pol = write_policy(tmp_path, shared_master.address)
    keys = session_keys(1, 4)["s0"]
    fill(pol, {"s0": keys})
    shared_file(tmp_path, keys[0]).unlink()  # as another node's eviction does
    out = cli("check", "-p", str(path))
    assert out.exit_code == 0 and "clean" in out.stdout and "1 notices" in out.stdout
    data = json.loads(cli("check", "--json", "-p", str(path)).stdout)
    assert data["clean"] and found(data["problems"]) == {("gone", "shared", keys[0])}
    fixed = cli("check", "--fix", "--json", "-p", str(path))
    assert fixed.exit_code == 0 and json.loads(fixed.stdout)["fixed"] == 1
    assert json.loads(fixed.stdout)["problems"] == []


def test_pool_entries_are_checked_against_the_master(tmp_path, shared_master):
    path, pol = write_policy(tmp_path, shared_master.address)
    held, gone = session_keys(1, 2)["s0"]
    with TieredStore(pol, mover=False) as store:  # keeps `held` in its pool segment
        assert store.save([held], frames_for([held])) == [True]
        entries = [Entry(k, "dram", size=block.HEADER_SIZE + PAYLOAD, checksum=1)
                   for k in (held, gone)]
        assert store.index.reserve(entries) == [True, True]
        store.index.commit("dram", [held, gone])
        # Another process, as an operator runs it (one LMDB handle per process).
        out = kvtier("inspect", "check", "--json", "-p", str(path))
        assert out.returncode == 1, out.stdout
        assert found(json.loads(out.stdout)["problems"]) == {("missing", "dram", gone)}
        out = kvtier("inspect", "check", "--fix", "--json", "-p", str(path))
        assert out.returncode == 0 and json.loads(out.stdout)["fixed"] == 1
        assert [e is not None for e in store.index.get("dram", [held, gone])] == [True, False]


def test_summary_sessions_and_blocks(tmp_path):
    path, pol = write_policy(tmp_path)
    sessions = session_keys(2, 4)
    fill(pol, sessions, waits_for={"s0": "tool"})
    summary = json.loads(cli("--json", "-p", str(path)).stdout)
    assert {t: (v["blocks"], v["pending"]) for t, v in summary["tiers"].items()} == \
        {"nvme": (8, 0), "shared": (8, 0)}
    assert summary["tiers"]["nvme"]["bytes"] == 8 * (block.HEADER_SIZE + PAYLOAD)
    assert summary["sessions"] == 2 and summary["health"]["stats_consistent"]
    assert summary["health"]["map_size_bytes"] == 64 << 20  # the policy's, read-only too
    assert "nvme" in cli("-p", str(path)).stdout

    rows = json.loads(cli("sessions", "--json", "-p", str(path)).stdout)
    assert {r["session"]: r["chain_blocks"] for r in rows} == {"s0": 4, "s1": 4}
    assert all(r["turns"] == 1 for r in rows)
    assert {r["session"]: r["waits_for"] for r in rows} == {"s0": "tool", "s1": None}
    table = cli("sessions", "-p", str(path)).stdout
    assert "s0" in table and "waits for" in table and "tool" in table

    key = sessions["s1"][2]
    rows = json.loads(cli("blocks", key, "0" * 48, "--json", "-p", str(path)).stdout)
    copies = {c["tier"]: c for c in rows[0]["copies"]}
    assert set(copies) == {"nvme", "shared"} and rows[1]["copies"] == []
    assert all(c["state"] == "READY" and c["size"] == block.HEADER_SIZE + PAYLOAD
               for c in copies.values())
    assert len({c["checksum"] for c in copies.values()}) == 1
    assert "not in this node's index" in cli("blocks", "0" * 48, "-p", str(path)).stdout
    assert cli("blocks", "nothex", "-p", str(path)).exit_code == 2


def test_summary_shows_the_candidate_each_tier_follows_and_its_shadows(tmp_path):
    data = policy_data(tmp_path)
    data["eviction"] = {"kind": "agentic", "select": True}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(data))
    pol = load_policy(path)
    sessions = session_keys(3, 4)
    with TieredStore(pol, mover=False) as store:
        for _ in range(2):  # the second turn of each session hits in every shadow
            for sid, keys in sessions.items():
                store.lookup(keys, SessionHint(sid))
                store.save(keys, frames_for(keys), SessionHint(sid))
                store.finish(keys, SessionHint(sid, gap_class="tool"))
    tiers = json.loads(cli("--json", "-p", str(path)).stdout)["tiers"]
    for name in ("nvme", "shared"):
        sel = tiers[name]["selection"]
        assert sel["following"] == "agentic" and sel["sampled_lookups"] == 6
        assert set(sel["shadows"]) == {"agentic", "lru", "s3fifo", "arc"}
        assert all(0 < s["hit_pct"] < 100 and 0 < s["recent_hit_pct"] < 100
                   for s in sel["shadows"].values()), "second turns hit, first ones miss"
    text = cli("-p", str(path)).stdout
    lru = tiers["nvme"]["selection"]["shadows"]["lru"]
    assert "nvme follows agentic" in text
    assert f"lru {lru['recent_hit_pct']:.1f}/{lru['hit_pct']:.1f}" in text


def test_gc_removes_junk_old_quarantine_and_unreferenced_blocks(tmp_path):
    path, pol = write_policy(tmp_path)
    kept, loose = session_keys(1, 4), session_keys(1, 3, first=1)
    fill(pol, kept)
    fill(pol, loose, finish=False)  # no stored session holds these
    (tmp_path / "nvme" / "junk").write_bytes(b"x")
    d = shared_file(tmp_path, kept["s0"][0]).parent
    aged(_touch(d / f".{kept['s0'][0]}.kvb.n.1.ab.tmp"), 7200)
    q = tmp_path / "shared" / QUARANTINE
    q.mkdir()
    old_q = _touch(q / f"{kept['s0'][1]}.n.{int((time.time() - 2 * 86400) * 1e9)}.kvb")
    new_q = _touch(q / f"{kept['s0'][2]}.n.{time.time_ns()}.kvb")
    kill_pending_writer(pol.index.path, "nvme", _key(9))

    before = _state(pol, tmp_path)
    dry = json.loads(cli("gc", "--dry-run", "--min-age-s", "0", "--json", "-p", str(path)).stdout)
    assert (dry["orphans"], dry["stale_temp"], dry["pending"], dry["quarantine"],
            dry["unreferenced"]) == (1, 1, 1, 1, 3)
    assert _state(pol, tmp_path) == before

    done = json.loads(cli("gc", "--min-age-s", "0", "--json", "-p", str(path)).stdout)
    assert {k: done[k] for k in dry if k != "dry_run"} == \
        {k: dry[k] for k in dry if k != "dry_run"}
    assert not old_q.exists() and new_q.exists()
    assert readable(pol, "nvme", kept["s0"] + loose["s1"]) == [True] * 4 + [False] * 3
    assert readable(pol, "shared", loose["s1"]) == [True] * 3  # shared: only with --shared
    shared = json.loads(cli("gc", "--shared", "--min-age-s", "0", "--json",
                            "-p", str(path)).stdout)
    assert shared["unreferenced"] == 3 and shared["orphans"] == 0
    assert readable(pol, "shared", kept["s0"] + loose["s1"]) == [True] * 4 + [False] * 3
    assert "removed" in cli("gc", "-p", str(path)).stdout
    assert check_node(pol).clean


def test_online_inspect_beside_a_live_writer(tmp_path):
    path, pol = write_policy(tmp_path, nvme="4MiB")  # small: regions are reclaimed under us
    stop = tmp_path / "stop"
    proc = start_worker("write", path, stop)
    try:
        held = wait_line(proc)["held"]
        checks, deadline = 0, time.time() + 6
        while time.time() < deadline:
            report = check_node(pol)
            assert report.problems == [], report.problems
            checks += 1
        rows = json.loads(cli("blocks", held, "--json", "-p", str(path)).stdout)
        assert [c["state"] for c in rows[0]["copies"]] == ["PENDING"]
        result = gc_node(pol)  # default min age: nothing of a live writer is collectable
        assert all(result[k] == 0 for k in ("orphans", "stale_temp", "pending",
                                             "bad_entries", "unreferenced")), result
        assert json.loads(cli("--json", "-p", str(path)).stdout)["health"]["pending"] >= 1
        # --fix beside it removes only what was planted (on a block the writer never reads:
        # its prefetch could otherwise meet the bad file first and quarantine it itself).
        truncated = shared_file(tmp_path, _key(7))
        _write_frame(truncated)
        truncated.write_bytes(truncated.read_bytes()[:500])
        orphan = _touch(tmp_path / "nvme" / "stray")
        report = check_node(pol, fix=True)
        assert report.clean and report.fixed == 2, report.to_dict()
        assert not truncated.exists() and not orphan.exists()
    finally:
        stop.touch()
    final = wait_line(proc)
    proc.wait(timeout=60)
    assert proc.returncode == 0
    assert final["bad"] == 0 and final["corrupt"] == 0 and final["reads"] > 0
    assert checks >= 3 and final["iterations"] > 30
    assert check_node(pol).clean
    ix = Index(pol.index.path, recover=False)  # every block the index still holds is sound
    held = {t: [k for k, e in zip(final["saved"], ix.get(t, final["saved"])) if e is not None]
            for t in ("nvme", "shared")}
    ix.close()
    assert len(held["shared"]) > 30
    for tier, keys in held.items():
        assert all(readable(pol, tier, keys)), tier


def test_check_of_a_missing_index_is_a_clear_error_and_makes_none(tmp_path):
    _, pol = write_policy(tmp_path)
    for run in (check_node, gc_node):
        with pytest.raises(IndexError_, match="no kvtier index at .*point index.path"):
            run(pol)
    assert not (tmp_path / "index").exists()


def test_a_tier_that_cannot_be_opened_is_unchecked_and_never_clean(tmp_path):
    path, pol = write_policy(tmp_path, master_address="127.0.0.1:1")  # no master there
    ix = Index(pol.index.path)
    assert ix.reserve([Entry(_key(1), "dram", size=block.HEADER_SIZE + PAYLOAD)]) == [True]
    ix.commit("dram", [_key(1)])
    ix.close()
    (tmp_path / "nvme").write_text("a file where the tier directory belongs")
    report = check_node(pol)
    assert report.problems == [] and not report.clean
    assert set(report.unchecked) == {"dram", "nvme"}
    assert "no master answers" in report.unchecked["dram"]
    out = cli("check", "-p", str(path))
    assert out.exit_code == 1 and "could not check nvme" in out.stdout
    assert cli("gc", "--dry-run", "-p", str(path)).exit_code == 1


def test_a_fresh_node_is_an_empty_table_and_inspect_makes_no_index(tmp_path):
    path, _ = write_policy(tmp_path)
    out = cli("-p", str(path))
    assert out.exit_code == 0 and "no index at" in out.stdout and "nvme" in out.stdout
    data = json.loads(cli("--json", "-p", str(path)).stdout)
    assert data["fresh"] and {t["blocks"] for t in data["tiers"].values()} == {0}
    assert json.loads(cli("sessions", "--json", "-p", str(path)).stdout) == []
    assert "not in this node's index" in cli("blocks", "0" * 48, "-p", str(path)).stdout
    assert not (tmp_path / "index").exists()


def test_the_tables_fit_80_columns_without_cutting_a_header(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    path, pol = write_policy(tmp_path)
    fill(pol, session_keys(2, 4), waits_for={"s0": "tool"})
    for args in ((), ("sessions",)):
        text = cli(*args, "-p", str(path)).stdout
        assert max(len(line) for line in text.splitlines()) <= 80, text
        assert "…" not in text, text
    summary = cli("-p", str(path)).stdout
    for header in ("capacity", "pending", "misses", "written", "errors"):
        assert header in summary, summary
    assert "waits for" in cli("sessions", "-p", str(path)).stdout


def test_sessions_count_what_the_pool_holds_now_and_mark_what_is_gone(tmp_path, shared_master):
    data = policy_data(tmp_path, shared_master.address)
    data["tiers"] = data["tiers"][:1]  # the pool alone: its blocks live as long as the lender
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(data))
    keys = session_keys(1, 3)["s0"]

    def rows(policy=path) -> dict:
        out = kvtier("inspect", "sessions", "--json", "-p", str(policy))
        assert out.returncode == 0, out.stderr
        return {r["session"]: r for r in json.loads(out.stdout)}

    with TieredStore(load_policy(path), mover=False) as store:  # lends the pool its segment
        hint = SessionHint("s0")
        store.lookup(keys, hint)
        assert all(store.save(keys, frames_for(keys), hint))
        store.finish(keys, hint)
        row = rows()["s0"]
        assert row["blocks_per_tier"] == {"dram": 3} and not row["gone"]
        assert row["state"] != "stale"  # its writer, this process, runs
        summary = json.loads(kvtier("inspect", "--json", "-p", str(path)).stdout)
        assert summary["tiers"]["dram"]["blocks"] == 3
    # The store took its segment back as it closed, and its blocks with it; the writer is
    # still this process, so the row is only gone.
    row = rows()["s0"]
    assert row["blocks_per_tier"] == {"dram": 0} and row["gone"]
    # A writer that exited: no process tracks the session, whatever its row said.
    ix = Index(tmp_path / "index")
    try:
        (sid, rec, chain), = list(read_sessions(ix))
        rec["writer"]["pid"] = dead_pid()
        write_sessions(ix, [(sid, rec, chain)])
    finally:
        ix.close()
    assert rows()["s0"]["state"] == "stale"
    # No master: the pool is gone with it; the reader is told, and nothing is started.
    data["master"]["address"] = "127.0.0.1:1"
    down = tmp_path / "down.yaml"
    down.write_text(yaml.safe_dump(data))
    out = kvtier("inspect", "sessions", "-p", str(down))
    assert out.returncode == 0 and "no master answers at 127.0.0.1:1" in out.stdout, out.stdout
    assert "gone" in out.stdout
