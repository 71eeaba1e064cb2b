"""The transfer pipeline of the mooncake tier, without Mooncake: chunking, staging placement
(a chunk never overlaps the one in flight), and no transfer outliving its call."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.mooncake.pipeline import plan_chunks, run_pipeline

MiB = 1 << 20


@pytest.fixture(scope="module")
def worker():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def test_direct_chunks_come_first_and_merge_for_puts():
    sizes, direct = [MiB] * 6, [True, False, True, False, True, False]
    chunks = plan_chunks(sizes, direct, 64 * MiB, merge_direct=True)
    assert [c.staged for c in chunks] == [False, True]
    assert chunks[0].idx == [0, 2, 4] and chunks[1].idx == [1, 3, 5]


def test_a_frame_larger_than_staging_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="staging"):
        plan_chunks([65 * MiB], [False], 64 * MiB)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20 * MiB), st.booleans()), min_size=1, max_size=40),
       st.sampled_from([32 * MiB, 64 * MiB]))
def test_pipeline_covers_every_index_once_without_overlap(items, staging_len):
    sizes = [n for n, _ in items]
    direct = [d for _, d in items]
    chunks = plan_chunks(sizes, direct, staging_len)
    assert sorted(i for c in chunks for i in c.idx) == list(range(len(items)))
    inflight: list = []  # staged spans currently transferring or awaiting post
    lock = threading.Lock()

    def xfer(chunk):
        if chunk.staged:
            start, end = chunk.span
            assert 0 <= start < end <= staging_len
            with lock:
                for other in inflight:
                    assert end <= other[0] or start >= other[1], "staging spans overlap"
                inflight.append(chunk.span)
        return [n for n in chunk.sizes]

    def post(chunk, got):
        assert got == chunk.sizes
        if chunk.staged:
            with lock:
                inflight.remove(chunk.span)

    with ThreadPoolExecutor(1) as pool:
        run_pipeline(pool, chunks, xfer, lambda c: None, post, staging_len)
    assert not inflight


def test_no_transfer_outlives_a_failing_call(worker):
    chunks = plan_chunks([8 * MiB] * 8, [True] * 8, 64 * MiB)
    assert len(chunks) > 2
    finished = []

    def xfer(chunk):
        time.sleep(0.02)
        finished.append(chunk.idx[0])
        return chunk.sizes

    def post(chunk, got):
        raise RuntimeError("bad frame")

    with pytest.raises(RuntimeError):
        run_pipeline(worker, chunks, xfer, lambda c: None, post, 64 * MiB)
    started = len(finished)
    time.sleep(0.05)
    assert len(finished) == started  # nothing was still running after the call returned
