"""The mooncake tier against a real mooncake_master: round trips, zero-copy and staged paths,
corruption of every kind, a full pool, an unreachable and a restarted master, two processes.

The generic contract suite (tests/tiers/test_contract.py) runs the same tier too; this file
holds what only the pool has (segments, leases, master restarts, codes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import answered, make_policy, metric_sum, start_master, wait_until
from kvtier.store.base.block import HEADER_SIZE, alloc_aligned, encode, payload_checksum
from kvtier.store.base.config import MasterConfig
from kvtier.store.base.errors import TierError, TierFullError, TierUnavailableError
from kvtier.store.base.index import Index
from kvtier.store.base.keys import Namespace
from kvtier.tiers import MISS, TierContext, open_tier
from kvtier.tiers.mooncake.client import MooncakeClient
from kvtier.tiers.mooncake.master import EmbeddedMaster, free_port

NS = Namespace(model="kvtier-test-mooncake").fingerprint()
OTHER_NS = Namespace(model="kvtier-test-other").fingerprint()
PEER = Path(__file__).with_name("mooncake_peer.py")


def new_key(ns: str = NS) -> str:
    return ns + os.urandom(16).hex()


def frames_for(n: int, size: int) -> tuple[list[str], list[bytearray]]:
    keys = [new_key() for _ in range(n)]
    return keys, [encode(k, os.urandom(size)) for k in keys]


def open_pool(root: Path, address: str, lend: bool = True, **tier) -> object:
    base = {"name": "dram", "kind": "mooncake", "capacity": "64MiB", "buffer": "16MiB",
            "staging": "32MiB", "retry_backoff_s": 0.01}
    policy = make_policy(root, master_address=address, tiers=[{**base, **tier}])
    index = Index(root / "index", 16 << 20)
    return open_tier(policy.tiers[0], TierContext(index, "test", policy.master, lend=lend))


@pytest.fixture(scope="module")
def pool(shared_master, tmp_path_factory):
    tier = open_pool(tmp_path_factory.mktemp("pool"), shared_master.address)
    yield tier
    tier.close()


@pytest.fixture(scope="module")
def raw(pool):
    """A second store client of this process, to write bytes the tier would never write."""
    client = MooncakeClient(pool.cfg.model_copy(update={"capacity_bytes": 32 << 20}),
                            pool.ctx.master)
    yield client
    client.close()


@pytest.mark.parametrize("size", [1 << 10, 256 << 10, 2 << 20, 16 << 20])
@pytest.mark.parametrize("registered", [False, True], ids=["staged", "zero-copy"])
def test_round_trip(pool, size, registered):
    keys, frames = frames_for(2, size)
    if registered:
        slot = -(-(HEADER_SIZE + size) // 4096) * 4096
        src, dst = alloc_aligned(2 * slot), alloc_aligned(2 * slot)
        pool.register(src)
        pool.register(dst)
        for i, f in enumerate(frames):
            src[i * slot:i * slot + len(f)] = f
        puts = [src[i * slot:i * slot + len(f)] for i, f in enumerate(frames)]
        outs = [dst[i * slot:(i + 1) * slot] for i in range(2)]
    else:
        puts, outs = frames, [bytearray(HEADER_SIZE + size) for _ in keys]
    assert pool.put(keys, puts) == [True, True]
    assert pool.contains(keys) == [True, True]
    assert pool.get(keys, outs) == [size, size]
    for out, frame in zip(outs, frames):
        assert bytes(out[:len(frame)]) == bytes(frame)
    assert pool.delete(keys) == 2
    assert pool.get(keys, outs) == [MISS, MISS]


def test_batch_pipeline_mixes_hits_misses_and_both_paths(pool):
    keys, frames = frames_for(24, 1 << 20)  # 24 MiB: several chunks, staging reused
    assert all(pool.put(keys, frames))
    missing = [new_key() for _ in range(3)]
    dst = alloc_aligned(8 * (2 << 20))
    pool.register(dst)
    outs = [dst[i * (2 << 20):(i + 1) * (2 << 20)] for i in range(8)]
    outs += [bytearray(HEADER_SIZE + (1 << 20)) for _ in range(16 + 3)]
    before = pool.counters()
    got = pool.get(keys + missing, outs)
    assert got == [1 << 20] * 24 + [MISS] * 3
    assert all(bytes(o[:len(f)]) == bytes(f) for o, f in zip(outs, frames))
    after = pool.counters()
    assert after["hits"] - before["hits"] == 24 and after["misses"] - before["misses"] == 3
    pool.delete(keys)


def test_existing_key_counts_as_stored_and_bad_frames_are_refused(pool):
    keys, frames = frames_for(1, 4096)
    assert pool.put(keys, frames) == [True]
    assert pool.put(keys, frames) == [True]
    with pytest.raises(ValueError, match="sealed for"):
        pool.put([new_key()], frames)
    with pytest.raises(ValueError, match="one buffer per key"):
        pool.get(keys, [])
    assert pool.put([], []) == [] and pool.get([], []) == [] and pool.contains([]) == []


def _corruptions(key: str, frame: bytearray) -> dict[str, bytes]:
    flipped = bytearray(frame)
    flipped[HEADER_SIZE + 100] ^= 0x01
    header = bytearray(frame)
    header[0:4] = b"XXXX"
    return {
        "bit flip": bytes(flipped),
        "truncated": bytes(frame[:-1000]),
        "wrong header": bytes(header),
        "wrong namespace": bytes(encode(OTHER_NS + key[16:], frame[HEADER_SIZE:])),
        "other key": bytes(encode(new_key(), frame[HEADER_SIZE:])),
    }


def test_corrupt_objects_are_counted_removed_and_missed(pool, raw):
    key = new_key()
    frame = encode(key, os.urandom(64 << 10))
    for what, bad in _corruptions(key, frame).items():
        with raw.session() as store:
            store.remove(key, True)
            assert store.put(key, bad) == 0, what
        before = pool.counters()["corrupt"]
        out = bytearray(len(frame))
        assert pool.get([key], [out]) == [MISS], what
        assert pool.counters()["corrupt"] == before + 1, what
        assert pool.contains([key]) == [False], f"{what}: not removed from the pool"


def test_too_small_out_buffer_is_a_caller_error_and_keeps_the_block(pool):
    keys, frames = frames_for(1, 64 << 10)
    pool.put(keys, frames)
    with pytest.raises(ValueError, match="smaller than the stored frame"):
        pool.get(keys, [bytearray(HEADER_SIZE + 1000)])
    assert pool.contains(keys) == [True]  # a sizing bug never wipes a shared block
    out = bytearray(len(frames[0]))
    assert pool.get(keys, [out]) == [64 << 10]
    pool.delete(keys)


def test_threads_share_one_tier(pool):
    errors = []

    def worker(i: int) -> None:
        try:
            for _ in range(5):
                keys, frames = frames_for(4, (64 << 10) * (i + 1))
                assert all(pool.put(keys, frames))
                outs = [bytearray(len(f)) for f in frames]
                assert MISS not in pool.get(keys, outs)
                assert [bytes(o) for o in outs] == [bytes(f) for f in frames]
                pool.delete(keys)
        except Exception as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_used_bytes_tracks_puts_and_deletes(pool):
    # No metrics endpoint known (a joined master): what this process put and still holds.
    base = pool.used_bytes()
    keys, frames = frames_for(3, 1 << 20)
    pool.put(keys, frames)
    assert pool.used_bytes() == base + sum(len(f) for f in frames)
    pool.delete(keys)
    assert pool.used_bytes() == base


def test_full_pool_raises_with_stored_keys_and_keeps_serving(tmp_path):
    master = start_master(tmp_path)
    tier = open_pool(tmp_path, master.address, capacity="16MiB", staging="8MiB")
    try:
        held, stored_frames = [], []
        with pytest.raises(TierFullError) as info:
            for _ in range(12):
                keys, frames = frames_for(2, 1 << 20)
                tier.contains(held)  # a read lease on every block: nothing is evictable
                t0 = time.monotonic()
                ok = tier.put(keys, frames)
                held += [k for k, s in zip(keys, ok) if s]
                stored_frames += [f for f, s in zip(frames, ok) if s]
        assert time.monotonic() - t0 >= 0.01 + 0.02 + 0.04 + 0.08  # backed off before giving up
        assert "nothing evictable" in str(info.value) and "capacity" in str(info.value)
        held += info.value.stored
        outs = [bytearray(HEADER_SIZE + (1 << 20)) for _ in held[:4]]
        assert MISS not in tier.get(held[:4], outs)
    finally:
        tier.close()
        master.stop()


def test_a_process_that_only_asks_lends_no_memory_and_reads_the_pool(tmp_path):
    """vLLM's scheduler process (its workers elsewhere) looks blocks up but stores none."""
    master = start_master(tmp_path)
    lender = open_pool(tmp_path / "a", master.address, capacity="16MiB", staging="8MiB")
    asker = open_pool(tmp_path / "b", master.address, lend=False, capacity="16MiB",
                      staging="8MiB")
    try:
        # the lender's segment only
        assert metric_sum(master.metrics_url, "master_total_capacity_bytes") == 16 << 20
        keys, frames = frames_for(2, 1 << 20)
        assert lender.put(keys, frames) == [True, True]
        assert asker.contains(keys + [new_key()]) == [True, True, False]
        outs = [bytearray(HEADER_SIZE + (1 << 20)) for _ in keys]
        assert asker.get(keys, outs) == [1 << 20, 1 << 20]
        assert [bytes(o) for o in outs] == [bytes(f) for f in frames]
    finally:
        asker.close()
        lender.close()
        master.stop()


def test_unreachable_master_at_start_is_a_clear_error(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(TierUnavailableError, match=f"{address}.*kvtier master"):
        open_pool(tmp_path, address)
    assert time.monotonic() - t0 < 5  # a TCP probe, not Mooncake's 90 s of setup retries


def test_embedded_master_is_started_when_none_answers(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    tiers = [{"name": "dram", "kind": "mooncake", "capacity": "16MiB", "staging": "8MiB"}]
    policy = make_policy(tmp_path, master_address=address, tiers=tiers,
                         master={"address": address, "embedded": True})
    tier = open_tier(policy.tiers[0], TierContext(Index(tmp_path / "ix", 16 << 20), "t",
                                                  policy.master))
    try:
        assert tier.client.owned_master is not None and tier.client.owned_master.alive()
        keys, frames = frames_for(1, 64 << 10)
        assert tier.put(keys, frames) == [True]
        # An owned master's metrics say what is allocated in this process's segment (the
        # only one in this pool).
        assert len(frames[0]) <= tier.used_bytes() <= tier.capacity_bytes
        tier.delete(keys)
        tier.usage.refresh()  # read the endpoint again now, not in a second
        assert tier.used_bytes() == 0
    finally:
        tier.close()
        tier.client.owned_master.stop()


class Ticker(threading.Thread):
    """Wakes every millisecond and keeps the longest gap between wakes: how long this
    process's Python threads were held (Mooncake's `close()` holds the GIL throughout)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.gap, self.done = 0.0, threading.Event()
        self.holds: list[tuple[float, float]] = []  # (start, end) of gaps over 50 ms

    def run(self) -> None:
        last = time.monotonic()
        while not self.done.wait(0.001):
            now = time.monotonic()
            if now - last > 0.05:
                self.holds.append((last, now))
            self.gap, last = max(self.gap, now - last), now

    def held_within(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1] this process's threads were held (by a close)."""
        return sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in list(self.holds))

    def stop(self) -> float:
        self.done.set()
        if self.ident is not None:  # started
            self.join(5)
        return self.gap


@pytest.mark.parametrize("files", [False, True], ids=["private", "segment_dir"])
@pytest.mark.parametrize("rebuild", [False, True], ids=["resumed", "rebuilt"])
def test_master_killed_mid_run_then_restarted_on_the_same_port(tmp_path, monkeypatch, files,
                                                               rebuild):
    """`resumed`: the client remounts its segment on the restarted master by itself, and
    calls resume on it; `rebuilt`: a client that has not recovered in `REBUILD_AFTER_S`
    (0 here) is replaced by a new one, which lends a new segment file."""
    from kvtier.tiers.mooncake import client as client_mod
    if rebuild:
        monkeypatch.setattr(client_mod, "REBUILD_AFTER_S", 0.0)
    port = free_port()
    cfg = MasterConfig(address=f"127.0.0.1:{port}")
    master = EmbeddedMaster(cfg, log_path=tmp_path / "m1.log").start()
    shm = tmp_path / "shm"
    tier = open_pool(tmp_path, master.address, **({"segment_dir": str(shm)} if files else {}))
    ticker = Ticker()
    try:
        first = tier.client._handle
        keys, frames = frames_for(2, 256 << 10)
        assert tier.put(keys, frames) == [True, True]
        master.kill()
        outs = [bytearray(len(f)) for f in frames]
        with pytest.raises(TierUnavailableError, match=f"127.0.0.1:{port}"):
            tier.get(keys, outs)
        t0 = time.monotonic()
        for op in (lambda: tier.contains(keys), lambda: tier.put(keys, frames),
                   lambda: tier.delete(keys)):
            with pytest.raises(TierUnavailableError, match=f"127.0.0.1:{port}.*kvtier master"):
                op()
        assert time.monotonic() - t0 < 1.0  # down: fail fast, no RPC retries
        ticker.start()
        master = EmbeddedMaster(cfg, log_path=tmp_path / "m2.log").start()
        # The client recovers in the background; until then every call skips the pool at
        # once rather than waiting for it.
        # (a rebuild's close holds the whole process a moment: not a wait for the reconnect)
        assert answered(lambda: tier.get(keys, outs),
                        held=ticker.held_within) == [MISS, MISS]  # a new master: empty
        assert (tier.client._handle is first) is not rebuild
        assert tier.put(keys, frames) == [True, True]  # same process, reconnected
        assert tier.get(keys, outs) == [256 << 10] * 2
        assert [bytes(o) for o in outs] == [bytes(f) for f in frames]
        if not rebuild:  # nothing froze the process (a rebuild's close holds it ~1-2 s)
            assert ticker.stop() < 1.0, f"the process was held {ticker.gap:.2f}s"
        if files:  # one lent file: the old client's went with it
            wait_until(lambda: len(list(shm.glob("kvtier-seg-*"))) == 1, 30,
                       "the old client's segment file to go")
            [seg] = shm.glob("kvtier-seg-*")
            assert bytes(frames[0][HEADER_SIZE:HEADER_SIZE + 256]) in seg.read_bytes(), \
                "a put after the restart did not land in this process's segment file"
    finally:
        ticker.stop()
        tier.close()
        master.stop()
    assert not files or not list(shm.glob("kvtier-seg-*"))


def test_a_client_whose_probe_put_keeps_failing_resumes_after_the_wait(tmp_path, monkeypatch,
                                                                       caplog):
    """After a master restart the client resumes once a probe put lands in its segment; a
    put that keeps failing while calls are answered (-200: a full pool looks like a segment
    not remounted yet) resumes the same client after `READY_WAIT_S`, not a rebuild."""
    from kvtier.tiers.mooncake import client as client_mod
    monkeypatch.setattr(client_mod, "READY_WAIT_S", 0.3)
    master = start_master(tmp_path)
    tier = open_pool(tmp_path, master.address)
    try:
        first = tier.client._handle
        real = tier.client._serves
        # the fault: every probe put is refused (a pool full of objects nothing can evict)
        monkeypatch.setattr(tier.client, "_serves", lambda store: real(store) and None)
        keys, frames = frames_for(1, 4096)
        master.kill()
        with pytest.raises(TierUnavailableError):
            tier.contains(keys)
        master = EmbeddedMaster(master.cfg, log_path=tmp_path / "m2.log").start()
        assert answered(lambda: tier.contains(keys)) == [False]
        assert tier.client._handle is first
        assert "a full pool, or a segment not remounted yet" in caplog.text
    finally:
        tier.close()
        master.stop()


def test_two_processes_exchange_blocks(tmp_path):
    from mooncake_peer import key_for, payload  # tests/tiers is on sys.path (rootdir import)

    master = start_master(tmp_path)
    peer = subprocess.Popen([sys.executable, str(PEER), master.address, str(tmp_path / "peer")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tier = None
    try:
        assert peer.stdout.readline().strip() == "ready"
        peer.stdin.write("put 7 300000\n")
        peer.stdin.flush()
        key = peer.stdout.readline().split()[1]
        # Opened after the peer's put, so the peer's segment was the only place for it.
        tier = open_pool(tmp_path, master.address)
        out = bytearray(HEADER_SIZE + 300000)
        assert tier.get([key], [out]) == [300000]
        assert bytes(out[HEADER_SIZE:]) == payload(7, 300000)
        mine = key_for(8)
        assert tier.put([mine], [encode(mine, payload(8, 123456))]) == [True]
        peer.stdin.write(f"get {mine} 8 123456\n")
        peer.stdin.flush()
        assert peer.stdout.readline().strip() == "ok"
        peer.kill()  # SIGKILL: its segment, and the block in it, are gone
        peer.wait()
        errors = tier.counters()["errors"]
        assert tier.get([key], [out]) == [MISS]  # a miss, never an exception
        assert tier.counters()["errors"] == errors + 1  # -800: its lender died (client TTL)
    finally:
        peer.kill()
        if tier is not None:
            tier.close()
        master.stop()


def test_missing_mooncake_package_names_the_install(monkeypatch):
    from kvtier.tiers.mooncake import client as mooncake_client

    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(TierError, match="pip install"):
        mooncake_client.import_mooncake()


def test_a_key_twice_in_one_get_fills_both_buffers(pool):
    # Mooncake's batch_get_into fills only the last buffer of a repeated key (and answers
    # success for both): the tier reads each key once and copies.
    keys, frames = frames_for(2, 8192)
    pool.put(keys, frames)
    order = [keys[0], keys[1], keys[0], keys[0]]
    outs = [bytearray(HEADER_SIZE + 8192) for _ in order]
    before = pool.counters()["corrupt"]
    assert pool.get(order, outs) == [8192] * 4
    assert [bytes(o) for o in outs] == [bytes(frames[k]) for k in (0, 1, 0, 0)]
    assert pool.counters()["corrupt"] == before
    pool.delete(keys)


def test_embedded_master_killed_is_replaced_in_the_background(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    tiers = [{"name": "dram", "kind": "mooncake", "capacity": "16MiB", "staging": "8MiB"}]
    policy = make_policy(tmp_path, master_address=address, tiers=tiers,
                         master={"address": address, "embedded": True})
    tier = open_tier(policy.tiers[0], TierContext(Index(tmp_path / "ix", 16 << 20), "t",
                                                  policy.master))
    first = tier.client.owned_master
    try:
        keys, frames = frames_for(1, 4096)
        assert tier.contains(keys) == [False]  # in use: its RPC connection is up
        first.kill()
        with pytest.raises(TierUnavailableError):
            tier.contains(keys)  # (a put would first spend ~4 s in Mooncake's retries)
        # the background reconnect starts a master of its own
        assert answered(lambda: tier.put(keys, frames)) == [True]
        assert tier.client.owned_master is not first and tier.client.owned_master.alive()
    finally:
        tier.close()
        tier.client.owned_master.stop()


@pytest.fixture
def lent_file(tmp_path):
    """A lender whose segment is a file in `files`, and a reader of the same node."""
    master = start_master(tmp_path)
    files = tmp_path / "shm"
    lender = open_pool(tmp_path / "a", master.address, capacity="16MiB", staging="8MiB",
                       segment_dir=str(files))
    reader = open_pool(tmp_path / "b", master.address, lend=False, capacity="16MiB",
                       staging="8MiB", segment_dir=str(files))
    yield lender, reader, files
    reader.close()
    lender.close()
    master.stop()


def flip_byte(files: Path, frame, at: int) -> None:
    """Flip byte `at` of `frame`'s payload where it lies in the lender's segment file."""
    [seg] = files.glob("kvtier-seg-*")
    mem = seg.read_bytes()
    start = mem.find(bytes(frame[HEADER_SIZE:HEADER_SIZE + 64]))
    assert start > 0
    with open(seg, "r+b") as f:
        f.seek(start + at)
        f.write(bytes([mem[start + at] ^ 1]))


def test_blocks_in_a_segment_file_are_read_straight_from_it(lent_file, monkeypatch):
    """`segment_dir`: the lender's segment is a file; a reader copies blocks out of it and
    sends only the rest (misses, bad frames) through Mooncake's transfer."""
    from kvtier.tiers.mooncake.segments import parse_name
    lender, reader, files = lent_file
    sent = []
    transfer = reader._transfer
    monkeypatch.setattr(reader, "_transfer",
                        lambda op, keys, *a, **kw: sent.append(list(keys)) or
                        transfer(op, keys, *a, **kw))
    [seg] = list(files.glob("kvtier-seg-*"))
    assert parse_name(seg.name)[2] == os.getpid()
    keys, frames = frames_for(3, 1 << 20)
    assert lender.put(keys, frames) == [True] * 3
    absent = new_key()
    outs = [bytearray(HEADER_SIZE + (1 << 20)) for _ in range(4)]
    assert reader.get(keys + [absent], outs) == [1 << 20] * 3 + [MISS]
    assert [bytes(o) for o in outs[:3]] == [bytes(f) for f in frames]
    assert sent == [[absent]]  # only the miss went through Mooncake

    # A frame that fails its check is read the usual way, which quarantines it.
    flip_byte(files, frames[0], 100)
    sent.clear()
    assert reader.get(keys[:2], outs[:2]) == [MISS, 1 << 20]
    assert sent == [[keys[0]]] and reader.counters()["corrupt"] == 1
    lender.close()
    assert not list(files.glob("kvtier-seg-*"))  # the lender took its file along


def sums_read(runs, n: int) -> list:
    """What a reader that used the frames of `runs` as they lie now checks: per key, the
    checksum of the payload it read (None outside the runs)."""
    out = [None] * n
    for run in runs:
        for j in range(run.count):
            off = run.offset + j * run.stride
            out[run.first + j] = payload_checksum(run.mem[off + HEADER_SIZE:off + run.size])
    return out


def test_blocks_in_a_segment_file_are_located_in_runs_and_checked_where_they_lie(lent_file):
    """`locate` hands out runs of frames at one stride in a lender's file (what a batch put
    leaves in a fresh segment); `verify_in_place` checks what the reader read, after the
    read, and a frame that fails is a MISS left to `get`, which quarantines it."""
    from kvtier.tiers.mooncake.tier import MIN_RUN
    lender, reader, files = lent_file
    keys, frames = frames_for(3 * MIN_RUN, 4096)
    assert lender.put(keys, frames) == [True] * len(keys)
    assert reader.locate(keys[:MIN_RUN - 1]) == []  # too few to be worth a batched op
    runs = reader.locate(keys)
    assert sorted(i for r in runs for i in range(r.first, r.first + r.count)) == \
        list(range(len(keys)))
    for run in runs:
        assert run.stride >= run.size == HEADER_SIZE + 4096
        for j in range(run.count):
            at = run.offset + j * run.stride
            assert bytes(run.mem[at:at + run.size]) == bytes(frames[run.first + j])
    assert reader.verify_in_place(keys, runs, sums_read(runs, len(keys))) == [4096] * len(keys)
    assert reader.counters()["in_place"] == len(keys)
    strict = open_pool(files.parent / "c", lender.ctx.master.address, lend=False,
                       capacity="16MiB", staging="8MiB", segment_dir=str(files),
                       read_in_place=False)
    try:  # copies and checks the copy instead
        assert strict.locate(keys) == []
        outs = [bytearray(HEADER_SIZE + 4096) for _ in keys]
        assert strict.get(keys, outs) == [4096] * len(keys)
        assert [bytes(o) for o in outs] == [bytes(f) for f in frames]
    finally:
        strict.close()

    # Two batches with other blocks put between them: not one stride from the first
    # frame to the last, so each block's place is asked for, and each batch is a run.
    more, more_frames = frames_for(2 * MIN_RUN, 4096)
    filler, filler_frames = frames_for(3, 4096)
    for ks, fs in ((more[:MIN_RUN], more_frames[:MIN_RUN]), (filler, filler_frames),
                   (more[MIN_RUN:], more_frames[MIN_RUN:])):
        assert lender.put(ks, fs) == [True] * len(ks)
    split = reader.locate(more)
    assert [(r.first, r.count) for r in split] == [(0, MIN_RUN), (MIN_RUN, MIN_RUN)]
    assert reader.verify_in_place(more, split, sums_read(split, len(more))) == \
        [4096] * len(more)

    # Another block where block 5 should be, block 5 after the last: a prediction from
    # the ends and every 16th key is wrong about block 5, which the check then catches.
    odd, odd_frames = frames_for(3 * MIN_RUN, 4096)
    other, other_frame = frames_for(1, 4096)
    for ks, fs in ((odd[:5], odd_frames[:5]), (other, other_frame),
                   (odd[6:], odd_frames[6:]), (odd[5:6], odd_frames[5:6])):
        assert lender.put(ks, fs) == [True] * len(ks)
    [guess] = reader.locate(odd)
    assert (guess.first, guess.count) == (0, len(odd))
    got = reader.verify_in_place(odd, [guess], sums_read([guess], len(odd)))
    assert got[5] == MISS and got[:5] + got[6:] == [4096] * (len(odd) - 1)
    out = bytearray(HEADER_SIZE + 4096)
    assert reader.get(odd[5:6], [out]) == [4096] and out == odd_frames[5]

    # A frame gone bad in the file: a MISS here, quarantined by `get`.
    flip_byte(files, frames[5], 100)
    runs = reader.locate(keys)
    got = reader.verify_in_place(keys, runs, sums_read(runs, len(keys)))
    assert got[5] == MISS and got[:5] + got[6:] == [4096] * (len(keys) - 1)
    assert reader.counters()["corrupt"] == 0  # not quarantined from here: `get` does it
    assert reader.get(keys[5:6], [bytearray(HEADER_SIZE + 4096)]) == [MISS]
    assert reader.counters()["corrupt"] == 1 and lender.contains(keys[5:6]) == [False]


def put_and_locate(lender, reader, n: int):
    """`n` fresh 4 KiB frames put by the lender and located by the reader: keys, frames,
    runs, and where in the segment each frame lies (every one in a run)."""
    keys, frames = frames_for(n, 4096)
    assert lender.put(keys, frames) == [True] * len(keys)
    runs = reader.locate(keys)
    at = {run.first + j: run.offset + j * run.stride
          for run in runs for j in range(run.count)}
    assert sorted(at) == list(range(len(keys)))
    return keys, frames, runs, at


def test_a_frame_rewritten_while_it_is_read_in_place_never_passes_the_check(lent_file):
    """Reading first and checking after is safe against a frame that changes meanwhile
    (its space reused by another block): whatever `verify_in_place` confirms equals what
    the reader read before, even with the frames rewritten under it while it reads."""
    from kvtier.tiers.mooncake.tier import MIN_RUN
    lender, reader, files = lent_file
    keys, frames, runs, at = put_and_locate(lender, reader, 4 * MIN_RUN)
    [seg] = files.glob("kvtier-seg-*")
    _, others = frames_for(len(keys), 4096)  # what lands where each frame was

    def rewrite() -> None:
        fd = os.open(seg, os.O_WRONLY)
        try:
            for i in range(len(keys)):
                os.pwrite(fd, bytes(others[i]), at[i])
                time.sleep(0.002)
        finally:
            os.close(fd)
    writer = threading.Thread(target=rewrite)
    writer.start()
    rounds = confirmed = 0
    while writer.is_alive() and rounds < 5000:
        rounds += 1
        read = {i: bytes(runs[0].mem[off:off + len(frames[i])]) for i, off in at.items()}
        used = [payload_checksum(read[i][HEADER_SIZE:]) for i in range(len(keys))]
        for i, n in enumerate(reader.verify_in_place(keys, runs, used)):
            if n != MISS:
                confirmed += 1
                assert read[i] == bytes(frames[i]), f"block {i} confirmed, read torn"
    writer.join()
    assert rounds > 1 and confirmed > 0  # the check ran against frames still whole
    assert reader.verify_in_place(keys, runs, sums_read(runs, len(keys))) == \
        [MISS] * len(keys)


def test_a_frame_replaced_and_put_back_while_read_fails_the_check_of_what_was_read(lent_file):
    """The one change a check of the frame where it lies could not see: the reader reads
    another block's bytes where its frame was, and the frame is back before the check. The
    check of checksums of what the reader used sees it; every other block still passes."""
    from kvtier.tiers.mooncake.tier import MIN_RUN
    lender, reader, files = lent_file
    keys, frames, runs, at = put_and_locate(lender, reader, 2 * MIN_RUN)
    [seg] = files.glob("kvtier-seg-*")
    _, [other] = frames_for(1, 4096)
    fd = os.open(seg, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(other), at[3])            # block 3's space, reused
        read = [bytearray(runs[0].mem[at[i]:at[i] + len(frames[i])]) for i in range(len(keys))]
        os.pwrite(fd, bytes(frames[3]), at[3])        # and block 3 put back in it
    finally:
        os.close(fd)
    assert read[3] == other and all(read[i] == frames[i] for i in at if i != 3)
    want = [4096] * len(keys)
    # the file is whole again: a check of the frames as they lie now would pass them all
    assert reader.verify_in_place(keys, runs, sums_read(runs, len(keys))) == want
    used = [payload_checksum(r[HEADER_SIZE:]) for r in read]  # of what the reader used
    got = reader.verify_in_place(keys, runs, used)
    assert got[3] == MISS and got[:3] + got[4:] == want[:3] + want[4:]
    used[3] = payload_checksum(frames[3][HEADER_SIZE:])       # had it read block 3 whole
    assert reader.verify_in_place(keys, runs, used) == want
    assert reader.verify_in_place(keys[1:] + keys[:1], runs, used) == [MISS] * len(keys)


def test_in_place_runs_are_one_mapping_one_stride_one_size():
    from kvtier.tiers.mooncake.tier import MIN_RUN, _runs
    a, b = memoryview(bytearray(1 << 20)), memoryview(bytearray(1 << 20))
    n = MIN_RUN

    def span(mem, start, count, stride=100, size=90):
        return [(mem, start + j * stride, size) for j in range(count)]
    runs = _runs(span(a, 0, n) + [None] + span(a, 5000, n + 1) + span(b, 0, n)
                 + span(a, 20000, n - 1))
    assert [(r.first, r.count, r.mem is a, r.offset) for r in runs] == \
        [(0, n, True, 0), (n + 1, n + 1, True, 5000), (2 * n + 2, n, False, 0)]
    # a change of stride or size ends a run; overlapping frames never make one
    assert [(r.first, r.count) for r in _runs(span(a, 0, n) + span(a, 810, n, stride=120))] \
        == [(0, n), (n, n)]
    assert _runs(span(a, 0, 2 * n, stride=50)) == []
    assert [r.count for r in _runs(span(a, 0, n) + span(a, 810, n, size=80))] == [n, n]


def test_segment_files_of_dead_lenders_are_swept_and_a_full_dir_is_a_clear_error(
        tmp_path, monkeypatch):
    from kvtier.tiers.mooncake import segments as mooncake_files
    files = tmp_path / "shm"
    files.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = files / mooncake_files.file_name("127.0.0.1:1234", 0x7f00, dead.pid)
    stale.write_bytes(b"x")
    unnamed = files / f"kvtier-seg-new-{dead.pid}-ab12cd34.mem"  # died before its mount
    unnamed.write_bytes(b"x")
    mine = files / mooncake_files.file_name("127.0.0.1:1235", 0x7f00, os.getpid())
    mine.write_bytes(b"x")
    assert mooncake_files.sweep(files) == 2
    assert not stale.exists() and not unnamed.exists() and mine.exists()

    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", no_space)  # a tmpfs smaller than capacity
    with pytest.raises(TierUnavailableError, match=r"cannot hold a 16 MiB segment.*--shm-size"):
        mooncake_files.LentFile(files, 16 << 20, "dram")
    assert {p.name for p in files.iterdir()} == {mine.name}


def test_segment_mappings_follow_their_files(tmp_path, monkeypatch):
    """A reader drops the mapping of a lender that stopped (it would keep the file's memory
    alive) and maps the file of a new lender at the same endpoint."""
    from kvtier.tiers.mooncake import segments as mooncake_files
    monkeypatch.setattr(mooncake_files, "REFRESH_S", 0.0)
    old = tmp_path / mooncake_files.file_name("127.0.0.1:7000", 0x1000, os.getpid())
    old.write_bytes(b"a" * 4096)
    other = tmp_path / mooncake_files.file_name("198.18.0.3:7000", 0x1000, os.getpid())
    other.write_bytes(b"c" * 4096)
    segs = mooncake_files.Segments(tmp_path, "127.0.0.1")
    view, base = segs.view("127.0.0.1:7000")
    assert base == 0x1000 and bytes(view[:1]) == b"a"
    assert segs.view("127.0.0.1:7001") is None
    # another host's lender, though its file is in the directory: the transfer engine's
    assert segs.view("198.18.0.3:7000") is None and segs.mapped == 1
    del view
    old.unlink()
    assert segs.view("127.0.0.1:7000") is None and segs._maps == {}
    new = tmp_path / mooncake_files.file_name("127.0.0.1:7000", 0x2000, os.getpid())
    new.write_bytes(b"b" * 4096)
    view, base = segs.view("127.0.0.1:7000")
    assert base == 0x2000 and bytes(view[:1]) == b"b"
    del view
    segs.close()


def test_map_all_maps_this_hosts_lenders_before_any_read(tmp_path):
    """An engine maps its node's lenders when it opens the tier, not at its first hit."""
    from kvtier.tiers.mooncake import segments as mooncake_files
    for endpoint, fill in (("127.0.0.1:7000", b"a"), ("127.0.0.1:7001", b"b"),
                           ("198.18.0.3:7000", b"c")):
        (tmp_path / mooncake_files.file_name(endpoint, 0x1000, os.getpid())).write_bytes(
            fill * 4096)
    segs = mooncake_files.Segments(tmp_path, "127.0.0.1")
    assert segs.map_all() == 2 and segs.mapped == 2  # another host's file stays unmapped
    assert set(segs._maps) == {"127.0.0.1:7000", "127.0.0.1:7001"}
    view, _ = segs.view("127.0.0.1:7001")
    assert bytes(view[:1]) == b"b" and segs.mapped == 2  # the read maps nothing more
    assert segs.map_all() == 0
    del view
    segs.close()
    assert mooncake_files.Segments(tmp_path, None).map_all() == 0


def test_a_lending_tier_maps_the_nodes_segment_files_at_open(lent_file, tmp_path):
    lender, reader, files = lent_file
    assert lender.segments.mapped == 1   # its own file, before any read
    assert reader.segments.mapped == 0   # a process that lends nothing maps on first read
    filled = lender.client._handle.lent._filler  # the lender zeroes its file while it starts
    assert filled is not None
    filled.join(30)
    assert not filled.is_alive()
    master_address = lender.ctx.master.address
    second = open_pool(tmp_path / "c", master_address, capacity="16MiB", staging="8MiB",
                       segment_dir=str(files))
    try:
        assert second.segments.mapped == 2  # the first lender's file and its own
    finally:
        second.close()


def test_a_lent_file_has_its_pages_zeroed_by_its_lender(tmp_path):
    """tmpfs zeroes an allocated page at its first fault, whoever takes it: the lender takes
    them all on a thread, not its first saves nor a reader's first mapping."""
    import mmap
    import numpy as np
    from kvtier.tiers.mooncake import segments as mooncake_files
    shm = Path("/dev/shm") / f"kvtier-test-{os.getpid()}-{tmp_path.name}"
    size = 32 << 20
    try:
        lent = mooncake_files.LentFile(shm, size, "dram")
        stopped = mooncake_files.LentFile(shm, size, "dram")
        stopped.stop_fill()  # never filled: nothing to end
        maps = []
        for each in (lent, stopped):
            with open(each.path, "r+b") as f:
                maps.append(mmap.mmap(f.fileno(), size))  # as Mooncake's mount maps it
        arrays = [np.frombuffer(mm, dtype=np.uint8) for mm in maps]
        assert _resident_kib(lent.path) == 0
        lent.fill(arrays[0].ctypes.data)
        lent._filler.join(30)
        assert _resident_kib(lent.path) == size >> 10  # every page, none of them written
        lent.stop_fill()
        stopped._stop_fill.set()  # as a close right after the mount
        stopped.fill(arrays[1].ctypes.data)
        stopped.stop_fill()
        assert _resident_kib(stopped.path) == 0
        del arrays
        for mm in maps:
            mm.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _resident_kib(path: Path) -> int:
    """Kilobytes of `path`'s mapping in this process's page tables (smaps `Rss`)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            return next(int(l.split()[1]) for l in lines[i + 1:] if l.startswith("Rss:"))
    raise AssertionError(f"{path} is not mapped")


def test_a_new_mapping_has_its_pages_mapped_in_the_background(tmp_path):
    """Reads must not pay a page fault per 4 KiB of a segment seen for the first time."""
    from kvtier.tiers.mooncake import segments as mooncake_files
    shm = Path("/dev/shm") / f"kvtier-test-{os.getpid()}-{tmp_path.name}"
    shm.mkdir()
    try:
        path = shm / mooncake_files.file_name("127.0.0.1:7000", 0x1000, os.getpid())
        with open(path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, 32 << 20)
        segs = mooncake_files.Segments(shm, "127.0.0.1")
        view, _ = segs.view("127.0.0.1:7000")
        mapped = segs._maps["127.0.0.1:7000"]
        assert mapped.populated.wait(30)
        assert _resident_kib(path) == 32 << 10  # every page, none of them read
        del view
        segs.close()
        assert not any(str(path) in l for l in Path("/proc/self/maps").read_text().splitlines())
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_lookups_skip_a_hung_pool_at_once_until_its_slow_lookup_answers(pool, monkeypatch):
    """A lookup with no answer in `call_timeout_s` while the master accepts connections (a
    master stopped, not gone) costs that timeout once; the lookups after it
    skip the pool at once while it is still running, and ask again once it has answered."""
    keys, frames = frames_for(2, 4096)
    assert pool.put(keys, frames) == [True, True]
    release = threading.Event()
    real = pool._exist

    def hung(batch):  # the fault: Mooncake's call hangs (a master stopped, not gone)
        release.wait(10)
        return real(batch)

    monkeypatch.setattr(pool, "_exist", hung)
    t0 = time.monotonic()
    with pytest.raises(TierUnavailableError, match="skips the pool"):
        pool.contains(keys)
    assert time.monotonic() - t0 >= pool.cfg.call_timeout_s * 0.9
    for _ in range(3):
        t0 = time.monotonic()
        with pytest.raises(TierUnavailableError, match="has not answered yet"):
            pool.contains(keys)
        assert time.monotonic() - t0 < 0.1
    monkeypatch.setattr(pool, "_exist", real)
    release.set()
    wait_until(lambda: not pool._lookups.hung(), 5, "the slow lookup answered")
    assert pool.contains(keys) == [True, True]
    pool.delete(keys)


def test_a_refused_put_lowers_what_the_pool_counts_as_usable_until_it_recovers(tmp_path):
    """A put the master refused for want of space (the master then evicts on its own) shows
    the segment fills before its capacity: `usable_bytes`, of which the mover's watermarks
    are fractions, loses a step (one a second however many puts are refused), never below
    half the capacity, and creeps back while no put is refused."""
    from kvtier.tiers.mooncake import usage as usage_mod
    master = start_master(tmp_path)
    tier = open_pool(tmp_path, master.address, capacity="16MiB", staging="8MiB")
    try:
        cap = tier.capacity_bytes
        assert tier.usable_bytes() == cap
        now = time.monotonic()
        tier.usage.clock = lambda: now  # every refusal below in the same second
        held = []
        with pytest.raises(TierFullError):
            for _ in range(12):
                keys, frames = frames_for(2, 1 << 20)
                tier.contains(held)  # a read lease on every block: nothing is evictable
                held += [k for k, s in zip(keys, tier.put(keys, frames)) if s]
        assert tier.usable_bytes() == int(cap - usage_mod.REFUSED_STEP * cap)
        for i in range(1, 60):  # refusals a second apart: a step each, down to the floor
            tier.usage.clock = lambda: now + i
            tier.usage.refused()
        assert tier.usable_bytes() == int(usage_mod.USABLE_FLOOR * cap)
        tier.usage.clock = lambda: now + 59 + 0.25 / usage_mod.RECOVER_PER_S
        assert abs(tier.usable_bytes() - 0.75 * cap) <= 1  # a quarter of the capacity back
        tier.usage.clock = lambda: now + 59 + 1 / usage_mod.RECOVER_PER_S
        assert tier.usable_bytes() == cap
    finally:
        tier.close()
        master.stop()
