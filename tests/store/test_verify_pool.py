"""Frames checked on every core: `verified_lens`, and `copied_verified_lens`, which copies each
frame out of a read-only mapping and checks the copy on the thread that made it."""

from __future__ import annotations

import mmap
import os
import threading

import pytest

from kvtier.store.base import block, verify_pool

KEYS = ["0123456789abcdef" + f"{i:02x}" * 16 for i in range(6)]


def frames(size: int) -> list[bytearray]:
    return [block.encode(k, os.urandom(size)) for k in KEYS]


def read_only(tmp_path, fs: list[bytearray]) -> tuple[mmap.mmap, list[memoryview]]:
    """The frames laid one after another in a file mapped read-only, as a lender's segment
    file is by its readers; a view of each."""
    path = tmp_path / "segment"
    path.write_bytes(b"".join(fs))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view, out, at = memoryview(mm), [], 0
    for f in fs:
        out.append(view[at:at + len(f)])
        at += len(f)
    return mm, out


@pytest.mark.parametrize("size", [4096, 2 << 20], ids=["small", "large"])
def test_copied_frames_are_checked_and_a_bad_or_foreign_one_is_none(tmp_path, monkeypatch, size):
    monkeypatch.setattr(verify_pool, "threads", lambda: 2)  # the parallel path on any host
    fs = frames(size)
    fs[1][block.HEADER_SIZE + size // 2] ^= 1  # a flipped payload byte
    fs[3] = block.encode(KEYS[4], os.urandom(size))  # sealed for another key
    mm, srcs = read_only(tmp_path, fs)
    dsts = [memoryview(bytearray(len(f) + 4096)) for f in fs]  # longer than the frames
    seen: list[str] = []
    one = verify_pool._one
    monkeypatch.setattr(verify_pool, "_one", lambda *a: seen.append(
        threading.current_thread().name) or one(*a))

    got = verify_pool.copied_verified_lens(dsts, srcs, KEYS)

    assert got == [size, None, size, None, size, size]
    for dst, f in zip(dsts, fs):
        assert bytes(dst[:len(f)]) == bytes(f)
        assert not any(dst[len(f):])  # nothing written past the frame
    # large frames are copied and checked on the pool's threads, small ones in the caller
    workers = {name.startswith("kvtier-verify") for name in seen}
    assert workers == ({True} if size >= verify_pool.PARALLEL_MIN_BYTES else {False})
    for view in srcs:
        view.release()
    mm.close()


def test_copied_lens_agree_with_verified_lens_and_an_empty_batch_is_empty(tmp_path):
    fs = frames(1 << 20)
    mm, srcs = read_only(tmp_path, fs)
    dsts = [memoryview(bytearray(len(f))) for f in fs]
    assert verify_pool.copied_verified_lens([], [], []) == []
    assert verify_pool.copied_verified_lens(dsts, srcs, KEYS) == \
        verify_pool.verified_lens([memoryview(f) for f in fs], KEYS, [len(f) for f in fs])
    for view in srcs:
        view.release()
    mm.close()
