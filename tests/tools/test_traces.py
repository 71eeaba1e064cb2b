"""Trace loaders and the synthetic workload: shapes, determinism, and malformed input
reported as one clear line (never a traceback)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.tools.policysim.segments import compile_workload
from kvtier.tools.workload.synthetic import SyntheticSpec, synthetic
from kvtier.tools.workload.traces import TraceError, load_mooncake, load_weka


def weka_file(path, requests, **top):
    doc = {"id": path.stem, "block_size": 64, "hash_id_scope": "local", "requests": requests,
           **top}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)


def req(t, ids, stop="tool_use", **kw):
    return {"t": t, "type": "n", "in": 64 * len(ids) + 10, "out": 5, "hash_ids": ids,
            "stop": stop, "output_types": ["tool_use"], "api_time": 1.5, **kw}


def test_weka_sessions_are_namespaced_coarsened_and_interleaved(tmp_path):
    for i in range(3):  # the same local ids in every file: they must not collide
        weka_file(tmp_path / f"trace_000{i}.json.gz", [
            req(0.0, [1, 2, 3, 4]), req(10.0, [1, 2, 3, 4, 5, 6, 7, 8], stop="end_turn"),
            {"t": 12.0, "type": "subagent", "requests": [req(0.0, [9, 10, 11, 12]),
                                                          req(3.0, [9, 10, 11, 12, 13])]}])
    w = load_weka(tmp_path, chunk_tokens=128, live=2)
    assert len(w) == 12 and w.block_tokens == 128
    assert w.unique_blocks == 3 * (4 + 2)  # 2-block chunks, per file: 1,2,3,4 and 5,6
    main = w.session == w.session[0]
    names = [w.gap_names[c] for c in w.gap_class[main]]
    assert names == ["tool:tool_use", "user"]  # stop reason, refined by the output types
    assert w.service_s[0] == 1.5
    assert len(set(w.session.tolist())) == 6  # three mains, three sub-agents
    # two slots: the third session starts only when one of the first two has ended
    assert w.arrival_s.max() == pytest.approx(15.0 + 1.0 + 15.0)
    assert np.all(np.diff(w.arrival_s) >= 0)


def test_mooncake_trace_drops_the_partial_tail_block(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [
        {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 1600, "output_length": 3, "hash_ids": [0, 1, 5, 6]},
    ]) + "\n")
    w = load_mooncake(p)
    assert [len(w.chain(i)) for i in range(2)] == [2, 3]
    assert w.arrival_s.tolist() == [0.0, 3.0] and w.block_tokens == 512


@pytest.mark.parametrize("line, why", [
    ("{not json", "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1.5]}', "hash_ids"),
    ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [1]}',
     "input_length"),
])
def test_malformed_mooncake_lines_name_the_line_and_field(tmp_path, line, why):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n'
                 + line + "\n")
    with pytest.raises(TraceError, match=why) as e:
        load_mooncake(p)
    assert f"{p}:2" in str(e.value) and "\n" not in str(e.value)


def test_malformed_weka_files_are_one_line_errors(tmp_path):
    (tmp_path / "trace_0001.json.gz").write_bytes(b"not gzip at all")
    with pytest.raises(TraceError, match="cannot read"):
        load_weka(tmp_path)
    weka_file(tmp_path / "trace_0001.json.gz", [{"t": "soon", "in": 5, "out": 1,
                                                 "hash_ids": []}])
    with pytest.raises(TraceError, match=r"request 0: field 't'"):
        load_weka(tmp_path)
    with pytest.raises(TraceError, match="no trace_"):
        load_weka(tmp_path / "nowhere")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_fuzzed_bytes_give_a_trace_error_or_a_workload(tmp_path, blob):
    p = tmp_path / "fuzz.jsonl"
    p.write_bytes(blob)
    try:
        load_mooncake(p)
    except TraceError as e:
        assert "\n" not in str(e)


def test_cli_reports_a_malformed_trace_in_one_line(tmp_path):
    (tmp_path / "weka_cc_traces").mkdir()
    (tmp_path / "conversation_trace.jsonl").write_text("{oops\n")
    out = subprocess.run([sys.executable, "-m", "kvtier.tools.cli", "replay", "--simulate",
                          "-w", "conversation", "--traces", str(tmp_path), "--jobs", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "not valid JSON" in out.stderr
    assert "Traceback" not in out.stderr


def test_synthetic_is_deterministic_and_shaped_as_designed():
    spec = SyntheticSpec(sessions=4, live=2, turns=5, seed=7)
    a, b = synthetic(spec), synthetic(spec)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.blocks, b.blocks)
    assert not np.array_equal(a.arrival_s, synthetic(SyntheticSpec(sessions=4, live=2,
                                                                   turns=5, seed=8)).arrival_s)
    assert len(a) == 20
    first = a.input_tokens[a.session == 0]
    assert first.tolist() == [30_000 + k * 2_948 for k in range(5)]
    shared = 20_000 // 256
    heads = {tuple(a.chain(i)[:shared]) for i in range(len(a))}
    assert len(heads) == 1  # the system prompt is one prefix for all
    with pytest.raises(TraceError):
        synthetic(SyntheticSpec(gap_median_s=10, gap_p99_s=5))


def test_segments_count_the_same_hits_as_blocks():
    w = synthetic(SyntheticSpec(sessions=6, live=3, turns=6, seed=1))
    c = compile_workload(w, max_segment_blocks=5)
    seen, by_block, by_seg = set(), 0, 0
    seen_seg = set()
    for r in range(len(w)):
        chain = w.chain(r).tolist()
        h = next((i for i, b in enumerate(chain) if b not in seen), len(chain))
        by_block += h
        seen.update(chain)
        segs = c.seg[c.seg_off[r]:c.seg_off[r + 1]].tolist()
        k = next((i for i, s in enumerate(segs) if s not in seen_seg), len(segs))
        by_seg += c.cum_blocks[c.seg_off[r] + k - 1] if k else 0
        seen_seg.update(segs)
    assert by_block == by_seg > 0
    assert c.seg_blocks.max() <= 5 and c.footprint_blocks == w.unique_blocks
