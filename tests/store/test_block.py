"""Block frames: round trips, and every kind of corruption is detected (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.store.base import block
from kvtier.store.base.errors import CorruptBlockError

KEY = "0123456789abcdef" + "ab" * 16
OTHER_NS = "fedcba9876543210" + KEY[16:]
OTHER_CHAIN = KEY[:16] + "cd" * 16


@given(st.binary(max_size=5000))
def test_round_trip(payload):
    frame = block.encode(KEY, payload)
    header = block.verify(frame, KEY)
    assert header.payload_len == len(payload) and header.key == KEY
    assert bytes(block.payload(frame)) == payload


def test_seal_in_place_with_padding():
    frame = block.alloc_aligned(block.frame_size(10_000, block.PAGE))
    frame[block.HEADER_SIZE:block.HEADER_SIZE + 10_000] = b"z" * 10_000
    block.seal(frame, KEY, 10_000)
    assert len(frame) % block.PAGE == 0
    assert block.verify(frame, KEY).payload_len == 10_000  # padding after the payload is fine


@settings(max_examples=300)
@given(st.binary(min_size=1, max_size=2000), st.data())
def test_any_single_bit_flip_is_detected(payload, data):
    frame = block.encode(KEY, payload)
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptBlockError):
        block.verify(frame, KEY)


@given(st.binary(min_size=1, max_size=2000), st.data())
def test_truncation_is_detected(payload, data):
    frame = block.encode(KEY, payload)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(CorruptBlockError, match="truncated"):
        block.verify(frame[:cut], KEY)
    with pytest.raises(CorruptBlockError, match="truncated"):
        block.verify(frame, KEY, length=cut)


@given(st.binary(max_size=block.HEADER_SIZE * 3))
def test_garbage_never_verifies(junk):
    with pytest.raises(CorruptBlockError):
        block.verify(junk, KEY)


def test_wrong_namespace_and_wrong_key():
    frame = block.encode(KEY, b"payload")
    with pytest.raises(CorruptBlockError, match="another namespace"):
        block.verify(frame, OTHER_NS)
    with pytest.raises(CorruptBlockError, match="another key"):
        block.verify(frame, OTHER_CHAIN)


def test_wrong_header_fields():
    frame = block.encode(KEY, b"payload")
    bad_magic = bytearray(frame)
    bad_magic[:4] = b"XXXX"
    with pytest.raises(CorruptBlockError, match="bad magic"):
        block.verify(bad_magic, KEY)
    zeros = bytes(len(frame))
    with pytest.raises(CorruptBlockError):
        block.verify(zeros, KEY)


def test_future_version_is_refused():
    import struct
    import xxhash
    frame = block.encode(KEY, b"p")
    frame[4:6] = struct.pack("<H", 99)
    frame[60:64] = struct.pack("<I", xxhash.xxh32_intdigest(bytes(frame[:60])))
    with pytest.raises(CorruptBlockError, match="version 99"):
        block.verify(frame, KEY)


def test_frame_too_small_to_seal():
    with pytest.raises(ValueError, match="cannot hold"):
        block.seal(bytearray(70), KEY, 100)


def test_verified_len_accepts_and_refuses_exactly_what_verify_does():
    import os
    from kvtier.store.base.block import CorruptBlockError, HEADER_SIZE, encode, verified_len, verify
    from kvtier.store.base.keys import Namespace, id_chain_hashes, make_keys
    ns = Namespace(model="kvtier-test-verified-len").fingerprint()
    key, other = make_keys(ns, id_chain_hashes([1, 2]))
    frame = bytes(encode(key, os.urandom(1000)))
    assert verified_len(memoryview(frame), key, len(frame)) == 1000 == \
        verify(frame, key, len(frame)).payload_len
    bad = {"payload": frame[:500] + bytes([frame[500] ^ 1]) + frame[501:],
           "header": frame[:20] + bytes([frame[20] ^ 1]) + frame[21:],
           "short": frame[:HEADER_SIZE + 999], "zeros": bytes(len(frame))}
    for name, b in bad.items():
        with pytest.raises(CorruptBlockError):
            verified_len(memoryview(b), key, len(b))
    with pytest.raises(CorruptBlockError, match="another key"):
        verified_len(memoryview(frame), other, len(frame))
    with pytest.raises(CorruptBlockError, match="truncated"):
        verified_len(memoryview(frame), key, len(frame) - 1)


@given(st.lists(st.binary(max_size=300), max_size=8))
def test_checksum_of_pieces_is_the_checksum_of_them_joined(pieces):
    assert block.checksum_of(pieces) == block.payload_checksum(b"".join(pieces))


def test_a_used_payload_passes_only_under_its_own_header():
    """`verify_used`: the checksum a reader computed of what it used must be the one the
    frame's header seals, for the key asked, at the length read."""
    payload = bytes(range(256)) * 4
    head = bytes(block.encode(KEY, payload)[:block.HEADER_SIZE])
    good = block.payload_checksum(payload)
    block.verify_used(head, KEY, len(payload), good)
    for args, reason in [((KEY, len(payload), good ^ 1), "differs from the frame"),
                         ((KEY, len(payload) - 1, good), "1023 bytes read"),
                         ((OTHER_NS, len(payload), good), "another namespace"),
                         ((OTHER_CHAIN, len(payload), good), "another key")]:
        with pytest.raises(CorruptBlockError, match=reason):
            block.verify_used(head, *args)
    torn = bytearray(head)
    torn[40] ^= 1
    with pytest.raises(CorruptBlockError, match="header checksum"):
        block.verify_used(bytes(torn), KEY, len(payload), good)


def test_deprioritize_lowers_only_the_calling_thread():
    """Background work (a segment's zeroing, a late transfer) yields the CPU to the rest."""
    import os
    import threading
    from kvtier.store.base.priority import LEAST_PRIORITY, deprioritize
    seen = []

    def body() -> None:
        deprioritize()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert seen == [LEAST_PRIORITY]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != LEAST_PRIORITY
    deprioritize(2 ** 22 + 12345)  # no such thread: nothing happens
