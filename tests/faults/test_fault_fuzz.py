"""Fuzzing of what kvtier parses from outside: block headers (`store/base/block.py`) and traces
(`tools/workload/traces.py`), with hypothesis (structure-aware: forged headers with valid header
checksums, almost-valid trace records with hostile field types).

Properties:
- `parse_header` and `verify` raise only `CorruptBlockError`, on any bytes;
- `verify(buf, key)` accepts only what `seal` would have written for that key and payload:
  acceptance implies authenticity (header, namespace, chain, length and checksum);
- a header forged with a correct header checksum but a hostile length, version or size
  never verifies against a frame that does not hold that many payload bytes;
- the trace loaders return a workload or raise `TraceError` with a one-line message, never
  another exception, on any record shape.
"""

from __future__ import annotations

import gzip
import json
import math

import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fault_util import NS, OTHER_NS, request_keys
from kvtier.store.base import block
from kvtier.store.base.errors import CorruptBlockError
from kvtier.store.base.keys import NS_HEX
from kvtier.tools.workload.traces import TraceError, load_mooncake, load_weka

KEY = request_keys("fuzz", 1)[0]
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FILES = settings(max_examples=120, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow,
                                        HealthCheck.function_scoped_fixture])


def forge(magic=block.MAGIC, version=block.VERSION, hsize=block.HEADER_SIZE, flags=0,
          key=KEY, plen=0, checksum=0) -> bytes:
    """A header with any field values and a correct header checksum."""
    body = block._BODY.pack(magic, version, hsize, flags, bytes.fromhex(key[:NS_HEX]),
                            bytes.fromhex(key[NS_HEX:]), plen, checksum)
    return body + block._CRC.pack(xxhash.xxh32_intdigest(body))


def accepted(buf: bytes, key: str = KEY) -> block.Header | None:
    try:
        return block.verify(buf, key)
    except CorruptBlockError:
        return None


@FUZZ
@given(st.binary(max_size=4 * block.HEADER_SIZE))
def test_random_bytes_raise_only_corrupt_block_errors(buf):
    try:
        block.parse_header(buf)
    except CorruptBlockError:
        pass
    assert accepted(buf) is None  # 2^-64 odds aside, noise is never a frame of KEY


@FUZZ
@given(version=st.integers(0, 0xFFFF), hsize=st.integers(0, 0xFFFF),
       flags=st.integers(0, 0xFFFFFFFF), plen=st.integers(0, 2**64 - 1),
       checksum=st.integers(0, 2**64 - 1), body=st.binary(max_size=512))
def test_forged_headers_with_valid_crc_never_verify_wrong_bytes(version, hsize, flags, plen,
                                                                  checksum, body):
    buf = forge(version=version, hsize=hsize, flags=flags, plen=plen, checksum=checksum) + body
    h = accepted(buf)
    if h is not None:  # only an exact, honest frame of KEY may pass
        assert (version, hsize) == (block.VERSION, block.HEADER_SIZE)
        assert plen <= len(body) and checksum == block.payload_checksum(body[:plen])
        assert bytes(block.encode(KEY, body[:plen], flags))[:block.HEADER_SIZE] == \
            buf[:block.HEADER_SIZE]


@FUZZ
@given(payload=st.binary(max_size=2048), data=st.data())
def test_mutations_of_a_sealed_frame_are_rejected(payload, data):
    frame = bytearray(block.encode(KEY, payload))
    n = data.draw(st.integers(1, 8))
    for _ in range(n):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    h = accepted(bytes(frame))
    if h is not None:  # the mutations put every byte back
        assert bytes(frame) == bytes(block.encode(KEY, payload))


@FUZZ
@given(payload=st.binary(max_size=1024), cut=st.integers(0, 2048), pad=st.binary(max_size=64))
def test_truncation_and_padding(payload, cut, pad):
    frame = bytes(block.encode(KEY, payload))
    if cut < len(frame):
        assert accepted(frame[:cut]) is None
    h = accepted(frame + pad)  # padding after a frame is allowed (aligned slots)
    assert h is not None and h.payload_len == len(payload)


@FUZZ
@given(payload=st.binary(max_size=512))
def test_another_namespace_under_a_colliding_name_is_refused(payload):
    other = OTHER_NS.fingerprint() + KEY[NS_HEX:]
    frame = bytes(block.encode(other, payload))
    assert accepted(frame, KEY) is None
    assert NS.fingerprint() != OTHER_NS.fingerprint()


# ---- traces ------------------------------------------------------------------------------

def hostile_values(depth: int = 2):
    leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
    if depth == 0:
        return leaf
    return leaf | st.lists(hostile_values(depth - 1), max_size=4) | \
        st.dictionaries(st.text(max_size=6), hostile_values(depth - 1), max_size=3)


ids = st.lists(st.integers(0, 2**40), max_size=6) | st.lists(hostile_values(1), max_size=4)
field = st.integers(0, 5000) | hostile_values(1)
mooncake_record = st.fixed_dictionaries(
    {}, optional={"timestamp": field, "input_length": field, "output_length": field,
                  "hash_ids": ids, "extra": hostile_values(1)})
# Valid everywhere but one field, so the fuzzing reaches the later checks too.
nearly_valid_mooncake = st.fixed_dictionaries(
    {"timestamp": st.integers(0, 10**6), "input_length": st.integers(0, 5000),
     "output_length": st.integers(0, 100), "hash_ids": ids})


def weka_request(depth: int):
    nearly_valid = st.fixed_dictionaries({"t": st.floats(0, 100), "in": st.integers(0, 9000),
                                          "out": st.integers(0, 99), "hash_ids": ids})
    plain = nearly_valid | st.fixed_dictionaries({}, optional={
        "t": field, "in": field, "out": field, "hash_ids": ids, "stop": hostile_values(0),
        "output_types": hostile_values(1), "api_time": field, "type": st.just("chat")})
    if depth == 0:
        return plain | hostile_values(1)
    sub = st.fixed_dictionaries({"type": st.just("subagent")}, optional={
        "t": field, "requests": st.lists(weka_request(depth - 1), max_size=3) | hostile_values(0)})
    return plain | sub


weka_doc = st.fixed_dictionaries({}, optional={
    "requests": st.lists(weka_request(2), max_size=4) | hostile_values(1),
    "block_size": st.just(64) | hostile_values(0)}) | hostile_values(1)


def one_line_error_or_workload(load, path) -> None:
    try:
        w = load(path)
    except TraceError as e:
        assert "\n" not in str(e) and str(e)
        return
    assert len(w) >= 1 and len(w.offsets) == len(w) + 1
    assert all(math.isfinite(x) or math.isinf(x) for x in w.arrival_s)


@FILES
@given(st.lists(nearly_valid_mooncake | mooncake_record | hostile_values(1), min_size=1,
                max_size=5))
def test_mooncake_loader_on_hostile_records(tmp_path, records):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    one_line_error_or_workload(load_mooncake, p)


@FILES
@given(weka_doc, st.booleans())
def test_weka_loader_on_hostile_sessions(tmp_path, doc, gz):
    for old in tmp_path.glob("trace_*"):
        old.unlink()
    raw = json.dumps(doc).encode()
    if gz:
        (tmp_path / "trace_0001.json.gz").write_bytes(gzip.compress(raw))
    else:
        (tmp_path / "trace_0001.json").write_bytes(raw)
    one_line_error_or_workload(lambda d: load_weka(d, live=2), tmp_path)
