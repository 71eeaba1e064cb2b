"""Session inference, reference counts, reclaim, and the online gap/end estimates."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.eviction.base import NO_META
from kvtier.store.sessions.tracker import SessionTracker, common_prefix


def turn(tr, keys, now, end=None, cls=None, **kw):
    t = tr.observe(keys, now, **kw)
    tr.end_turn(t.session, now + 0.5 if end is None else end, cls)
    return t


def test_a_request_extending_a_chain_is_the_next_turn_of_its_session():
    tr = SessionTracker()
    a = turn(tr, ["sys", "a1"], 0.0)
    b = turn(tr, ["sys", "a1", "a2", "a3"], 5.0)
    assert a.new_session and not b.new_session
    assert (b.session, b.turn, b.common, b.dropped) == (a.session, 2, 2, 0)
    assert tr.meta("a3") == (a.session, 3, 1)


def test_sessions_forking_from_a_shared_prompt_are_new_and_share_it_once_each():
    tr = SessionTracker()
    first = turn(tr, ["sys", "p", "a1"], 0.0)
    ids = {first.session}
    for i in range(1, 1000):
        t = turn(tr, ["sys", "p", f"u{i}"], float(i))
        assert t.new_session
        ids.add(t.session)
    assert len(ids) == 1000 and len(tr) == 1000
    assert tr.meta("sys").shared_by == 1000
    assert tr.known_keys == 2 + 1000  # the prompt is known once


def test_first_turn_divergence_is_a_new_session_but_a_later_edit_is_a_rewrite():
    tr = SessionTracker()
    a = turn(tr, ["sys", "a1", "a2"], 0.0)
    b = turn(tr, ["sys", "b1", "b2"], 1.0)  # same prompt, different first input
    assert b.new_session
    turn(tr, ["sys", "a1", "a2", "a3", "a4"], 10.0)
    edit = turn(tr, ["sys", "a1", "a2", "x3"], 20.0)  # the last message edited
    assert edit.session == a.session and edit.dropped == 2
    _, reclaim = tr.reap(21.0)
    assert set(reclaim) == {"a3", "a4"}  # nobody references the dropped suffix


def test_hints_override_inference():
    tr = SessionTracker()
    turn(tr, ["sys", "a1"], 0.0, session="A")
    t = turn(tr, ["other"], 1.0, session="A")
    assert t.session == "A" and t.turn == 2 and t.dropped == 2
    t = turn(tr, ["sys", "a1", "a2"], 2.0, session="B")
    assert t.session == "B" and t.new_session
    tr.observe(["sys", "a1", "a2", "a3"], 3.0, session="B", expected_gap_s=100.0)
    tr.end_turn("B", 3.5)
    # the hinted gap is the median, give or take the chance that the session ended
    assert tr.predicted_return("B", 3.5, 0.5) == pytest.approx(103.5, rel=0.05)


def test_gap_estimate_learns_a_lognormal_and_falls_back_to_the_global_one():
    tr = SessionTracker()
    rng = np.random.default_rng(0)
    t = 0.0
    for s in range(50):
        chain = [f"s{s}"]
        for k in range(10):
            turn(tr, chain, t, end=t + 0.5)
            t += 0.5 + rng.lognormal(math.log(20.0), 0.8)
            chain = chain + [f"s{s}-{k}"]
    mu, sigma = tr.model.global_params(None)
    assert math.exp(mu) == pytest.approx(20.0, rel=0.15)
    assert sigma == pytest.approx(0.8, rel=0.15)
    fresh = turn(tr, ["brand-new"], t, end=t)
    assert tr.predicted_return(fresh.session, t, 0.5) - t == pytest.approx(20.0, rel=0.2)


def test_ended_sessions_are_reaped_and_their_blocks_reported_for_reclaim():
    tr = SessionTracker()
    turn(tr, ["sys", "a1"], 0.0)
    turn(tr, ["sys", "b1"], 1.0)
    ended, keys = tr.reap(30.0)
    assert ended == [] and keys == []
    ended, keys = tr.reap(100_000.0)
    assert len(ended) == 2 and set(keys) == {"sys", "a1", "b1"}
    assert tr.meta("a1") is NO_META and len(tr) == 0


def test_end_probability_is_learned_from_silence():
    tr = SessionTracker()
    for s in range(200):  # every session stops after one turn
        turn(tr, [f"x{s}"], float(s))
    tr.reap(500.0)  # no session is old enough to be ended, but all are long silent
    assert tr.model.p_end(None, 1) > 0.8
    assert tr.reuse_probability(tr.sessions()[-1], 500.0, 60.0) < 0.05


def test_reuse_probability_and_predictions_are_consistent():
    tr = SessionTracker()
    t = turn(tr, ["a"], 0.0, end=1.0, cls="tool")
    p_short = tr.reuse_probability(t.session, 2.0, 5.0)
    p_long = tr.reuse_probability(t.session, 2.0, 500.0)
    assert 0 < p_short < p_long <= 1
    q1, q9 = (tr.predicted_return(t.session, 2.0, q) for q in (0.1, 0.9))
    assert 2.0 <= q1 < q9
    assert tr.hot_until(t.session, 0.9) > 1.0
    assert tr.info(t.session, 2.0).state in ("hot", "idle")


def test_a_turn_in_service_is_expected_to_end_as_such_turns_usually_do():
    """An agent answers a tool result with a message to the person and the person's message
    with a tool call: while a turn is served, the gap ahead is the one that usually follows
    the gap before it, not that one again."""
    tr = SessionTracker()
    t = 0.0
    for s in range(20):  # tool call (3 s) -> answer (600 s) -> tool call -> answer
        chain = [f"s{s}"]
        for k in range(4):
            cls, gap = ("tool", 3.0) if k % 2 == 0 else ("user", 600.0)
            turn(tr, chain, t, end=t + 1.0, cls=cls)
            t += 1.0 + gap
            chain = chain + [f"s{s}-{k}"]

    def mu_of(sid, cls):  # the session's own estimate for a class, as the tracker forms it
        return tr.model.params(tr._sessions[sid].stats.get(cls), cls)[0]

    first = tr.observe(["new"], t)            # a first turn: first turns end on tool calls
    sid = first.session
    assert tr.snapshot(sid).mu == mu_of(sid, "tool")
    tr.end_turn(sid, t + 1.0, "tool")
    assert tr.snapshot(sid).mu == mu_of(sid, "tool")
    tr.observe(["new", "n1"], t + 4.0)        # back from the tool; the answer is served
    assert tr.snapshot(sid).mu == mu_of(sid, "user")
    assert tr.info(sid, t + 4.0).waits_for == "user"  # what `inspect sessions` shows
    tr.end_turn(sid, t + 5.0, "user")
    tr.observe(["new", "n1", "n2"], t + 600)  # the person's message is served
    assert tr.snapshot(sid).mu == mu_of(sid, "tool")
    assert mu_of(sid, "user") > mu_of(sid, "tool") + 1.0


def test_the_gap_ahead_keeps_the_last_class_until_enough_turns_were_seen():
    tr = SessionTracker()
    sid = turn(tr, ["a"], 0.0, end=1.0, cls="user").session
    turn(tr, ["a", "b"], 2.0, end=3.0, cls="tool")
    tr.observe(["a", "b", "c"], 4.0)
    assert tr._ahead(tr._sessions[sid]) == "tool"  # one turn seen, not FOLLOW_MIN


def test_change_log_tells_readers_which_sessions_moved():
    tr = SessionTracker()
    a = turn(tr, ["a"], 0.0)
    changed, cur = tr.changes(0)
    assert changed == [a.session, a.session]
    b = turn(tr, ["b"], 1.0)
    changed, cur2 = tr.changes(cur)
    assert changed == [b.session, b.session] and cur2 == cur + 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6)), max_size=40))
def test_reference_counts_match_the_live_chains(ops):
    """Random extensions and rewrites of a few sessions: every key's count is the number of
    live chains holding it, and every released key was reported."""
    tr, chains, reported = SessionTracker(), {}, set()
    for i, (s, cut) in enumerate(ops):
        base = chains.get(s, [f"root{s}"])
        chain = base[:max(1, len(base) - cut)] + [f"{s}.{i}"]
        tr.observe(chain, float(i), session=s)
        tr.end_turn(s, i + 0.5)
        chains[s] = chain
        reported.update(tr.reap(float(i + 1))[1])
    for key in {k for c in chains.values() for k in c}:
        assert tr.refs(key) == sum(key in c for c in chains.values())
    ever = {k for s, cut in ops for k in [f"root{s}"]}
    assert ever <= {k for c in chains.values() for k in c} | reported


def test_common_prefix_by_binary_search():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_an_inferred_session_id_is_the_same_wherever_its_first_request_is_seen():
    a, b = SessionTracker(), SessionTracker()
    first = turn(a, ["sys", "p", "u1"], 0.0)
    assert turn(b, ["sys", "p", "u1"], 7.0).session == first.session
    other = turn(a, ["sys", "p", "u2"], 10.0)
    assert other.session != first.session


def test_two_writers_of_one_session_keep_both_chains_in_its_manifest(tmp_path):
    from kvtier.store.base.index import Index
    from kvtier.store.sessions.persist import read_sessions, write_sessions

    keys = [f"{i:048x}" for i in range(6)]
    ix = Index(tmp_path / "index")
    try:
        write_sessions(ix, [("s1", {"turns": 1}, keys[:4])])
        write_sessions(ix, [("s1", {"turns": 2}, keys[:2] + keys[4:])])
        (sid, rec, chain), = list(read_sessions(ix))
    finally:
        ix.close()
    assert (sid, rec) == ("s1", {"turns": 2})
    assert chain[:4] == keys[:2] + keys[4:] and sorted(chain) == keys


def test_session_rows_are_written_off_the_callers_thread_in_order(tmp_path, caplog):
    """A turn's end must not wait on the index's write lock (another process of the node may
    hold it) or its sync: the row is queued, written in order, and `flush` waits for it."""
    import threading
    import time

    from kvtier.store.base.index import Index
    from kvtier.store.sessions.persist import RowWriter, read_sessions

    keys = [f"{i:048x}" for i in range(4)]
    ix = Index(tmp_path / "index")
    rows = RowWriter(ix)
    held, release = threading.Event(), threading.Event()

    def hold(txn):  # another writer holds the index's write lock
        held.set()
        release.wait(10)

    holder = threading.Thread(target=ix.run_write, args=(hold,))
    holder.start()
    try:
        assert held.wait(10)
        t0 = time.monotonic()
        rows.put([("s1", {"turns": 1}, keys[:2])])
        rows.put([("s1", {"turns": 2}, keys)])
        assert time.monotonic() - t0 < 0.5
        assert not list(read_sessions(ix))  # still queued behind the lock
    finally:
        release.set()
        holder.join(10)
    rows.flush()
    (sid, rec, chain), = list(read_sessions(ix))
    assert (sid, rec, chain) == ("s1", {"turns": 2}, keys)  # the later row is the last one

    # a failed write is logged and the writer goes on
    rows.put([("s2", {"turns": 1}, ["not a key"])])
    rows.put([("s3", {"turns": 1}, keys[:1])])
    rows.close()
    assert "the row of session s2 not written" in caplog.text
    assert {sid for sid, _, _ in read_sessions(ix)} == {"s1", "s3"}
    with pytest.raises(Exception, match="after the store was closed"):
        rows.put([("s4", {"turns": 1}, keys[:1])])
    ix.close()
