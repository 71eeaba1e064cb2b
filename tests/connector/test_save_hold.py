"""A request's saves wait while its prompt is still being computed on the host's cores: until
its prefill ends, for at most the hold, and never once the engine would wait for a save
buffer; loads and other requests' saves pass them, and a load never waits for a save being
written (a real store: a real master, real files, real LMDB; a paged cache in host
memory)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import make_policy, wait_until
from kvtier.connector.io_thread import IOThread, LoadBatch, SaveBatch, stage_save
from kvtier.connector.layout import PagedKV
from kvtier.connector.staging import StagingPool
from kvtier.connector.stats import KVTierStats
from kvtier.store.base import block
from kvtier.store.tiered import TieredStore

LAYERS, BLOCKS, HEADS, BLOCK_TOKENS, HEAD = 2, 64, 2, 16, 32
PER_BUFFER = 4  # chunks of one block each per staging buffer


def open_store(root, master) -> TieredStore:
    policy = make_policy(root, master_address=master.address, tiers=[
        {"name": "dram", "kind": "mooncake", "capacity": "16MiB", "buffer": "8MiB",
         "staging": "8MiB"},
        {"name": "nvme", "kind": "nvme", "path": str(root / "nvme"), "capacity": "8MiB",
         "region_size": "1MiB"}])
    return TieredStore(policy, mover=False)


@pytest.fixture
def io(tmp_path, shared_master):
    """An I/O thread over a real store, two save buffers, saves held up to `hold` s."""
    made = []

    def make(hold: float, buffers: int = 2, idle: float = 0.0):
        store = open_store(tmp_path, shared_master)
        raw = torch.randn(LAYERS, BLOCKS, HEADS, BLOCK_TOKENS, 2 * HEAD)
        paged = PagedKV({f"layers.{i}": raw[i] for i in range(LAYERS)}, BLOCKS, BLOCK_TOKENS)
        payload = paged.info.block_bytes
        stride = block.frame_size(payload, block.PAGE)
        saves = StagingPool(PER_BUFFER, stride, paged.device, buffers)
        loads = StagingPool(PER_BUFFER, stride, paged.device, 1)
        thread = IOThread(store, paged, loads, saves, 1, payload, KVTierStats(),
                          threading.Lock(), hold_saves_s=hold, idle_s=idle)
        made.append((thread, store))
        return thread, store, paged, saves

    yield make
    for thread, store in made:
        thread.stop()
        store.close()


def submit(thread, paged, pool, tag: str, req: str = "r") -> list[str]:
    keys = [f"{tag}{i:02x}".ljust(48, "0") for i in range(PER_BUFFER)]
    buf = pool.acquire(timeout_s=5.0)
    assert buf is not None, "the engine waited for a save buffer"
    ready = stage_save(paged, buf, [[i] for i in range(PER_BUFFER)], 1)
    thread.submit_save(SaveBatch(req, keys, buf, None, ready))
    return keys


def stored(store, keys) -> bool:
    return all(store.tiers[0].contains(keys))


def test_a_save_waits_for_the_prefill_to_end(io):
    thread, store, paged, pool = io(hold=30.0)
    thread.prefilling({"r"})
    keys = submit(thread, paged, pool, "aa")
    time.sleep(0.5)
    assert thread.pending_saves() == 1 and not any(store.tiers[0].contains(keys))
    t0 = time.monotonic()
    thread.prefilling(())
    wait_until(lambda: stored(store, keys), 10.0, "the held save after the prefill ended")
    assert time.monotonic() - t0 < 5.0


def test_a_save_waits_for_the_end_of_the_step_that_ended_its_prefill(io):
    """That step goes on to sample the first token: a save started with it would take the
    core and the GIL the sampling needs."""
    thread, store, paged, pool = io(hold=30.0, idle=30.0)
    thread.prefilling({"r"})
    keys = submit(thread, paged, pool, "ca")
    thread.prefilling(())  # the prefill's last step computed; its step goes on
    time.sleep(0.5)
    assert thread.pending_saves() == 1 and not any(store.tiers[0].contains(keys))
    t0 = time.monotonic()
    thread.step_ended()
    wait_until(lambda: stored(store, keys), 10.0, "the save once the step ended")
    assert time.monotonic() - t0 < 5.0


def test_a_one_step_prompts_save_waits_for_its_steps_end(io):
    thread, store, paged, pool = io(hold=30.0, idle=30.0)
    keys = submit(thread, paged, pool, "cc")  # gathered by the step that computes it all
    time.sleep(0.3)
    thread.prefilling(())
    time.sleep(0.3)
    assert thread.pending_saves() == 1 and not any(store.tiers[0].contains(keys))
    thread.step_ended()
    wait_until(lambda: stored(store, keys), 10.0, "the save once its step ended")
    thread.step_ended()  # told again (the next step's start): nothing more to release
    later = submit(thread, paged, pool, "cd")
    thread.prefilling(())
    time.sleep(0.3)
    assert not any(store.tiers[0].contains(later))  # this step has not ended


def test_steps_that_saved_nothing_leave_the_next_save_waiting_for_its_own_step(io):
    """Most decode steps queue no save, and their step bookkeeping takes no lock: the first
    save after them still waits while the step that gathered it goes on, even once the
    engine had been quiet for longer than `idle_s`."""
    thread, store, paged, pool = io(hold=30.0, idle=0.3)
    for _ in range(3):  # steps with nothing to save, each told its end (one twice)
        thread.prefilling(())
        thread.step_ended()
    thread.step_ended()
    time.sleep(0.5)
    keys = submit(thread, paged, pool, "ce")  # its step's worker part is not done yet
    time.sleep(0.3)
    assert thread.pending_saves() == 1 and not any(store.tiers[0].contains(keys))
    thread.prefilling(())
    thread.step_ended()
    wait_until(lambda: stored(store, keys), 10.0, "the save once its step ended")


def test_a_save_whose_step_end_goes_untold_waits_only_for_an_idle_engine(io):
    """A worker in a process of its own learns of a step's end only from the next step: an
    engine with nothing more to do must not keep what it computed unsaved."""
    thread, store, paged, pool = io(hold=30.0, idle=0.3)
    thread.prefilling({"r"})
    keys = submit(thread, paged, pool, "cb")
    t0 = time.monotonic()
    thread.prefilling(())
    wait_until(lambda: stored(store, keys), 10.0, "the save of an idle engine")
    assert 0.3 <= time.monotonic() - t0 < 5.0


def test_a_save_waits_at_most_the_hold(io):
    thread, store, paged, pool = io(hold=0.3)
    thread.prefilling({"r"})
    t0 = time.monotonic()
    keys = submit(thread, paged, pool, "bb")
    wait_until(lambda: stored(store, keys), 10.0, "a save held past its hold")
    assert time.monotonic() - t0 >= 0.3  # it did wait, the engine still busy


def test_a_save_goes_once_the_engine_would_wait_for_a_buffer(io):
    thread, store, paged, pool = io(hold=30.0, buffers=2)
    thread.prefilling({"r"})
    first = submit(thread, paged, pool, "cc")
    time.sleep(0.3)
    assert not any(store.tiers[0].contains(first))  # one buffer left: held
    second = submit(thread, paged, pool, "dd")  # the last buffer: the oldest save goes
    wait_until(lambda: stored(store, first), 10.0, "the oldest save with no buffer left")
    assert pool.has_room()
    assert not any(store.tiers[0].contains(second))  # a buffer free again: this one waits
    third = submit(thread, paged, pool, "ee")  # would have blocked without the release
    thread.stop()  # stopping finishes what is held
    assert stored(store, second) and stored(store, third)


def test_without_a_hold_saves_go_at_once(io):
    thread, store, paged, pool = io(hold=0.0)
    thread.prefilling({"r"})
    keys = submit(thread, paged, pool, "ff")
    wait_until(lambda: stored(store, keys), 10.0, "a save with no hold")


def test_loads_are_not_held_behind_a_held_save(io):
    thread, store, paged, pool = io(hold=30.0)
    keys = submit(thread, paged, pool, "ab")
    thread.prefilling(())  # the worker's part of that step is done
    wait_until(lambda: stored(store, keys), 10.0, "a save before the prefill")
    thread.prefilling({"r"})
    held = submit(thread, paged, pool, "ac")
    thread.submit_load([LoadBatch("q", keys, [[BLOCKS - 1 - i] for i in range(PER_BUFFER)],
                                  0, last=True)])
    done: list[str] = []
    wait_until(lambda: done.extend(thread.take_results()[0]) or "q" in done, 10.0,
               "a load while a save is held")
    assert thread.pending_saves() == 1 and not any(store.tiers[0].contains(held))
    assert torch.equal(paged_rows(paged, [BLOCKS - 1 - i for i in range(PER_BUFFER)]),
                       paged_rows(paged, list(range(PER_BUFFER))))


def test_a_load_does_not_wait_for_a_save_being_written(io, monkeypatch):
    thread, store, paged, pool = io(hold=0.0)
    keys = submit(thread, paged, pool, "ad")
    wait_until(lambda: stored(store, keys), 10.0, "a first save")
    # A save the store takes long to write (a busy pool, a slow disk): held here until
    # released, so the load below arrives while it is being written.
    writing, release = threading.Event(), threading.Event()
    save = store.save

    def slow_save(*args, **kwargs):
        writing.set()
        release.wait(30.0)
        return save(*args, **kwargs)

    monkeypatch.setattr(store, "save", slow_save)
    try:
        slow = submit(thread, paged, pool, "ae")
        assert writing.wait(10.0), "the save never started"
        rows = [BLOCKS - 1 - i for i in range(PER_BUFFER)]
        thread.submit_load([LoadBatch("q", keys, [[r] for r in rows], 0, last=True)])
        done: list[str] = []
        wait_until(lambda: done.extend(thread.take_results()[0]) or "q" in done, 10.0,
                   "a load while a save is being written")
        assert not any(store.tiers[0].contains(slow))  # still being written
        assert torch.equal(paged_rows(paged, rows), paged_rows(paged, list(range(PER_BUFFER))))
    finally:
        release.set()
    wait_until(lambda: stored(store, slow), 10.0, "the slow save once the store took it")


def paged_rows(paged, ids):
    return torch.stack([v[ids] for v in paged.views])


def test_another_requests_save_passes_a_held_one(io):
    thread, store, paged, pool = io(hold=30.0, buffers=3)
    thread.prefilling({"r"})
    held = submit(thread, paged, pool, "ba")
    done = submit(thread, paged, pool, "bb", req="s")  # its prefill is over
    wait_until(lambda: stored(store, done), 10.0, "a finished request's save")
    assert not any(store.tiers[0].contains(held))
    thread.prefilling({"r", "t"})  # still computing: still held
    time.sleep(0.3)
    assert not any(store.tiers[0].contains(held))
    thread.prefilling({"t"})
    wait_until(lambda: stored(store, held), 10.0, "the save once its own prefill ended")
