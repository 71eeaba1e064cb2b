"""The LMDB index: two-phase protocol, recovery, multi-process use, crashes, growth."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, precondition

from kvtier.store.base.errors import IndexError_, IndexFullError
from kvtier.store.base.index import Index
from kvtier.store.base.index_record import PENDING, READY, Entry

KEYS = [f"{i:02x}" * 24 for i in range(12)]
TIERS = ["nvme", "shared"]


def test_reserve_commit_abort_delete(tmp_path):
    ix = Index(tmp_path / "ix")
    k1, k2 = KEYS[:2]
    assert ix.reserve([Entry(k1, "nvme", size=100, loc_a=3, loc_b=4096),
                       Entry(k2, "nvme", size=50)]) == [True, True]
    assert ix.reserve([Entry(k1, "nvme", size=1)]) == [False]  # one copy per (key, tier)
    assert ix.locate([k1, k2]) == [{}, {}]  # PENDING is invisible to lookups
    assert ix.get("nvme", [k1], ready_only=False)[0].state == PENDING
    assert ix.commit("nvme", [k1]) == 1
    assert [e.tier for e in ix.locate([k1])[0].values()] == ["nvme"]
    assert ix.get("nvme", [k1])[0].loc_a == 3 and ix.tier_usage("nvme") == (1, 100)
    assert [e.key for e in ix.abort("nvme", [k1, k2])] == [k2]  # READY entries survive abort
    assert ix.pending_count() == 0
    assert [e.key for e in ix.delete("nvme", [k1])] == [k1]
    assert ix.tier_usage("nvme") == (0, 0) and ix.locate([k1]) == [{}]


def test_one_block_in_several_tiers(tmp_path):
    ix = Index(tmp_path / "ix")
    for tier in ("dram", "nvme", "shared"):
        ix.reserve([Entry(KEYS[0], tier, size=10)])
        ix.commit(tier, [KEYS[0]])
    assert sorted(ix.locate([KEYS[0]])[0]) == ["dram", "nvme", "shared"]
    ix.delete("nvme", [KEYS[0]])
    assert sorted(ix.locate([KEYS[0]])[0]) == ["dram", "shared"]


def test_namespace_identity_mismatch_is_refused(tmp_path):
    Index(tmp_path / "ix", identity="llama/tenant-a").close()
    with pytest.raises(IndexError_, match="belongs to namespace 'llama/tenant-a'"):
        Index(tmp_path / "ix", identity="qwen/tenant-a")


def test_map_grows_then_reports_full(tmp_path):
    ix = Index(tmp_path / "ix", map_size_bytes=1 << 20, max_map_size_bytes=4 << 20)
    entries = [Entry(f"{i:048x}", "nvme", size=1, session="s" * 200) for i in range(4000)]
    for i in range(0, 4000, 500):
        ix.reserve(entries[i:i + 500])
    assert ix.map_size_bytes > 1 << 20
    with pytest.raises(IndexFullError, match="raise index.max_map_size"):
        for i in range(4000, 40000, 500):
            ix.reserve([Entry(f"{j:048x}", "nvme", session="s" * 200) for j in range(i, i + 500)])


def _hold_pending(path, key, ready):
    ix = Index(path)
    ix.reserve([Entry(key, "nvme", size=7)])
    ready.set()
    time.sleep(60)


def test_recover_removes_pending_of_dead_owners_only(tmp_path):
    path = tmp_path / "ix"
    ix = Index(path)
    ix.reserve([Entry(KEYS[0], "nvme", size=1)])  # owned by this live process
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_hold_pending, args=(path, KEYS[1], ready))
    child.start()
    assert ready.wait(30)
    assert ix.recover() == []  # both owners alive
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    gone = ix.recover()
    assert [e.key for e in gone] == [KEYS[1]]
    assert ix.pending_count() == 1  # ours is still there
    assert ix.get("nvme", [KEYS[0]], ready_only=False)[0].state == PENDING


def test_reopens_itself_after_fork(tmp_path):
    ix = Index(tmp_path / "ix")
    ix.reserve([Entry(KEYS[0], "nvme", size=1)])
    ix.commit("nvme", [KEYS[0]])
    pid = os.fork()
    if pid == 0:  # child: must not reuse the parent's environment
        try:
            ok = ix.locate([KEYS[0]])[0]["nvme"].size == 1
            ix.reserve([Entry(KEYS[1], "nvme", size=2)])
            ix.commit("nvme", [KEYS[1]])
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ix.locate([KEYS[1]])[0]["nvme"].size == 2


WRITER = """
import random, sys, time
from kvtier.store.base.index import Index
from kvtier.store.base.index_record import Entry
ix = Index(sys.argv[1])
rng = random.Random(int(sys.argv[2]))
print("ready", flush=True)
i = 0
while True:
    keys = [f"{rng.randrange(1 << 64):048x}" for _ in range(rng.randint(1, 40))]
    ix.reserve([Entry(k, "nvme", size=4096, checksum=int(k[-8:], 16)) for k in keys])
    if rng.random() < 0.8:
        ix.commit("nvme", keys)
    else:
        ix.abort("nvme", keys)
    if rng.random() < 0.3:
        ix.delete("nvme", keys[: len(keys) // 2])
    i += 1
"""


def test_sigkill_mid_transaction_leaves_a_consistent_index(tmp_path):
    path = tmp_path / "ix"
    rng = random.Random(7)
    for round_ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(round_)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ix = Index(path)  # recovery runs on open
        entries = list(ix.scan())
        ready = [e for e in entries if e.state == READY]
        assert all(e.state == READY for e in entries), "a dead writer's PENDING survived open"
        assert ix.pending_count() == 0
        assert all(e.checksum == int(e.key[-8:], 16) and e.size == 4096 for e in ready)
        assert ix.tier_usage("nvme") == (len(ready), 4096 * len(ready))
        ix.close()


class IndexMachine(RuleBasedStateMachine):
    """Random reserve/commit/abort/delete/reopen sequences against a model of the index."""

    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = tempfile.mkdtemp()
        self.ix = Index(self.dir)
        self.model: dict[tuple[str, str], tuple[int, int]] = {}  # (key, tier) -> (state, size)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
          tier=st.sampled_from(TIERS), size=st.integers(1, 10_000))
    def reserve(self, keys, tier, size):
        got = self.ix.reserve([Entry(k, tier, size=size) for k in keys])
        for k, ok in zip(keys, got):
            assert ok == ((k, tier) not in self.model)
            if ok:
                self.model[(k, tier)] = (PENDING, size)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4, unique=True),
          tier=st.sampled_from(TIERS))
    def commit(self, keys, tier):
        n = self.ix.commit(tier, keys)
        expect = [k for k in keys if self.model.get((k, tier), (0,))[0] == PENDING]
        assert n == len(expect)
        for k in expect:
            self.model[(k, tier)] = (READY, self.model[(k, tier)][1])

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4, unique=True),
          tier=st.sampled_from(TIERS))
    def abort(self, keys, tier):
        gone = {e.key for e in self.ix.abort(tier, keys)}
        expect = {k for k in keys if self.model.get((k, tier), (0,))[0] == PENDING}
        assert gone == expect
        for k in expect:
            del self.model[(k, tier)]

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4, unique=True),
          tier=st.sampled_from(TIERS))
    def delete(self, keys, tier):
        gone = {e.key for e in self.ix.delete(tier, keys)}
        expect = {k for k in keys if (k, tier) in self.model}
        assert gone == expect
        for k in expect:
            del self.model[(k, tier)]

    @rule()
    def reopen(self):
        # Same process: its PENDING entries are still owned by a live process and stay.
        self.ix.close()
        self.ix = Index(self.dir)

    @precondition(lambda self: any(s == PENDING for s, _ in self.model.values()))
    @rule()
    def crash(self):
        # Pretend the owner died: rewrite owners to a pid that cannot exist, then recover.
        with self.ix._txn(write=True) as txn:
            from kvtier.store.base.index_record import decode_entry, encode_entry
            db = self.ix._db("blocks")
            for k, raw in list(txn.cursor(db=db)):
                e = decode_entry(raw)
                if e.state == PENDING:
                    txn.put(k, encode_entry(e.replace(owner_pid=2**31 - 7)), db=db)
        self.ix.recover()
        self.model = {k: v for k, v in self.model.items() if v[0] == READY}

    @invariant()
    def agrees_with_model(self):
        found = {(e.key, e.tier): (e.state, e.size) for e in self.ix.scan()}
        assert found == self.model
        for tier in TIERS:
            ready = [size for (k, t), (s, size) in self.model.items() if t == tier and s == READY]
            assert self.ix.tier_usage(tier) == (len(ready), sum(ready))
        located = self.ix.locate(KEYS)
        for k, copies in zip(KEYS, located):
            assert set(copies) == {t for (kk, t), (s, _) in self.model.items()
                                   if kk == k and s == READY}

    def teardown(self):
        self.ix.close()
        shutil.rmtree(self.dir)  # one per example, outside pytest's tmp_path


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
