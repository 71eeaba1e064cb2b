"""The generated workloads: deterministic per seed, and of the shape their docs state."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.tools.workload.generators import GENERATORS, chat, forks, rag, retime
from kvtier.tools.workload.traces import GAP_CLASSES


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f))
               for f in ("arrival_s", "input_tokens", "session", "gap_class", "blocks",
                         "offsets"))


@pytest.fixture(scope="module")
def made():
    return {name: gen(0) for name, gen in GENERATORS.items()}


@pytest.mark.parametrize("name", list(GENERATORS))
def test_each_generator_is_deterministic_per_seed(name, made):
    again, other = GENERATORS[name](0), GENERATORS[name](1)
    assert _same(made[name], again)
    assert not _same(made[name], other)
    w = made[name]
    assert np.all(np.diff(w.arrival_s) >= 0) and len(w) > 500
    assert np.all(w.input_tokens == np.diff(w.offsets) * w.block_tokens)


def _sessions(w):
    out: dict = {}
    for i, s in enumerate(w.session.tolist()):
        out.setdefault(s, []).append(i)
    return out


def _prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def test_forks_have_sub_agents_forked_from_a_parent_prefix_running_at_once(made):
    w = made["forks"]
    by = _sessions(w)
    system = _prefix(w.chain(by[0][0]), w.chain(by[1][0]))  # what any two parents share
    forked = 0
    for s, reqs in by.items():
        first = w.chain(reqs[0])
        parents = [o for o, r in by.items() if o != s
                   and w.arrival_s[r[0]] < w.arrival_s[reqs[0]]
                   and any(_prefix(w.chain(i), first) > system and len(w.chain(i)) <= len(first)
                           and _prefix(w.chain(i), first) == len(w.chain(i)) for i in r)]
        forked += bool(parents)
    assert forked >= len(by) // 3, "most sessions are sub-agents forked from a parent"
    # siblings run at once: some sessions' lifetimes overlap with a sibling's
    spans = sorted((w.arrival_s[r[0]], w.arrival_s[r[-1]]) for r in by.values())
    assert sum(b0 < a1 for (a0, a1), (b0, b1) in zip(spans, spans[1:])) > len(spans) // 4
    assert set(w.gap_class.tolist()) == {GAP_CLASSES.index("tool")}


def test_chat_sessions_are_short_with_human_gaps(made):
    w = made["chat"]
    by = _sessions(w)
    assert 3 <= np.mean([len(r) for r in by.values()]) <= 5
    gaps = [w.arrival_s[b] - w.arrival_s[a] for r in by.values() for a, b in zip(r, r[1:])]
    assert 30 <= np.median(gaps) <= 90, "a person answers in about a minute"
    assert "tool" not in {GAP_CLASSES[c] for c in w.gap_class.tolist()}
    heads = {int(w.chain(r[0])[0]) for r in by.values()}
    assert len(heads) == 1, "one small system prompt shared by every session"
    assert np.median(w.input_tokens) < 8_000


def test_rag_shares_large_documents_among_many_short_sessions_beside_long_agents(made):
    w = made["rag"]
    by = _sessions(w)
    lengths = sorted(len(r) for r in by.values())
    assert lengths[-4] >= 20 and lengths[-5] <= 2, "four long agents, the rest short"
    # the second block after the system prompt is a document's: popular ones recur
    firsts = [int(w.chain(r[0])[8]) for r in by.values() if len(r) <= 2]
    _, counts = np.unique(firsts, return_counts=True)
    assert counts.max() > 0.05 * len(firsts) and len(counts) > 20
    assert np.median(w.input_tokens) > 8_000, "documents are large"


def test_retime_scales_arrivals_and_keeps_the_requests():
    w, base = chat(2), chat(2)
    retime(w, 0.1)
    assert np.allclose(w.arrival_s, base.arrival_s * 0.1)
    assert np.array_equal(w.blocks, base.blocks) and np.array_equal(w.service_s, base.service_s)
    assert "time x0.1" in w.name
    assert forks(0, parents=2, turns=3).name != rag(0, sessions=5, agents=1).name


@pytest.mark.parametrize("name", list(GENERATORS))
def test_a_larger_population_has_that_many_times_the_sessions_over_the_same_time(name, made):
    assert _same(GENERATORS[name](0, population=1), made[name])
    one, four = made[name], GENERATORS[name](0, population=4)
    ratio = len(set(four.session.tolist())) / len(set(one.session.tolist()))
    assert 3.0 <= ratio <= 5.0, ratio
    assert 3.0 <= len(four) / len(one) <= 5.0
    # the same time span (within the spread of the sessions' own lengths)
    assert four.arrival_s[-1] <= 2.0 * one.arrival_s[-1]
    assert np.all(np.diff(four.arrival_s) >= 0)
