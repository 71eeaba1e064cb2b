"""A hit never costs much more than recomputing it: loads from a lender that stalls are given
up at their deadline and recomputed, and only what was loaded counts as a hit.

Engines `a` (the lender: its own segment of the pool, over TCP, as the README's plain setup
has it) and `b` (the reader), in two processes on one real master. `a` is frozen with
SIGSTOP while `b` loads blocks from `a`'s segment: the transfer hangs (Mooncake gives up
after 30 s or more), so only the deadline can end `b`'s wait.
"""

from __future__ import annotations

import os
import signal
import statistics

import pytest

pytest.importorskip("vllm")

from engine_util import (  # noqa: E402  (tests/connector is on sys.path)
    cluster, Engines, full_block_tokens, in_pool, make_tiny_model, random_prompt, wait_for)
from kvtier.store.base.index import Index  # noqa: E402
from kvtier.store.counters import read_counters  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.alone]
# The issue's own request size. At 4K a stall costs its deadline, a recompute and 0-0.1 s
# more (0.05 s at the median of a fresh-clone CI run, where a cold took 0.14 s): at that
# size the fixed part alone is a third of a recompute; at 8K it is a tenth.
LONG = 8192
OLD_STALL_S = 30.0  # what the same load cost before deadlines: Mooncake's own give-up


@pytest.fixture(scope="module")
def engines(tmp_path_factory, cluster):
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")
    pool = Engines(model, tmp_path_factory.mktemp("engine-logs"))
    yield pool
    pool.close()


def engine(engines, cluster, name):
    return engines.get(name, cluster.transfer_config(name, load_deadline=True, tiers=("dram",)))


def ttft(eng, prompt):
    """(output, seconds) of a one-token request: its time to first token."""
    outs, elapsed = eng.generate([prompt], 1)
    return outs[0], elapsed


def test_a_stalled_lender_costs_the_deadline_then_a_recompute_not_a_hit(engines, cluster):
    a, b = engine(engines, cluster, "a"), engine(engines, cluster, "b")
    # b learns its own prefill cost (a few seconds of serving) and the pool's read rate from
    # real work first, as any engine that has served a while has.
    for seed in range(10, 16):  # sizes up to the test's own: the model is asked at LONG
        ttft(b, random_prompt(seed, LONG // 4 * (1 + seed % 4)))
    for seed in (1, 2):
        warm = random_prompt(seed, LONG)
        ttft(a, warm)
        wait_for(lambda: in_pool(cluster, warm), 30, "a's saves of the prompt")
        hit, _ = ttft(b, warm)
        assert hit.kv_transfer_params["kvtier"]["hit_tokens"].get("dram", 0) > 0
    colds = [ttft(b, random_prompt(seed, LONG))[1] for seed in (3, 4, 5)]
    # Five stalls, each on a prompt only a holds: one TTFT on a shared two-core host moves
    # by tens of milliseconds (and one in a few by ~0.1 s: a fresh-clone CI run saw 0.36 s
    # beside 0.24 and 0.25 at 4K), so the bound is checked on medians side by side.
    stalls, declined = [], []
    for seed in (6, 16, 26, 36, 46):
        prompt = random_prompt(seed, LONG)
        ttft(a, prompt)
        wait_for(lambda: in_pool(cluster, prompt), 30, "a's saves of the prompt")
        os.kill(a.pid, signal.SIGSTOP)  # its blocks lie in its segment, and it answers nothing
        try:
            out, stalled = ttft(b, prompt)
        finally:
            os.kill(a.pid, signal.SIGCONT)  # the abandoned transfers end, their staging freed
        kv = out.kv_transfer_params["kvtier"]
        # Nothing of the found blocks landed: they count as recomputed (promised, then cut
        # at the deadline) or declined (b, having measured the pool that slow, computed them
        # without waiting), never as a hit.
        assert kv["hit_tokens"] == {}
        assert kv["recomputed_tokens"] + kv["declined_tokens"] >= 0.9 * full_block_tokens(prompt)
        assert out.token_ids == engines.baseline(prompt, 1).token_ids
        assert stalled < OLD_STALL_S
        if kv["recomputed_tokens"]:
            stalls.append((stalled, max(kv["load_deadlines_ms"]) / 1e3))
        else:
            declined.append(stalled)
    # cold before and after: a busy host slows both alike
    colds += [ttft(b, random_prompt(seed, LONG))[1] for seed in (7, 8, 9)]
    cold = statistics.median(colds)
    assert len(stalls) >= 2, f"only {len(stalls)} of 5 loads were cut at a deadline"
    for t in declined:  # computed at once: a cold prefill
        assert t <= 2 * max(colds), f"declined {declined}, colds {colds}"
    deadline_s = statistics.median(d for _, d in stalls)
    stalled = statistics.median(t for t, _ in stalls)
    # waiting costs at most what recomputing saves: the deadline is the recompute b's own
    # model predicts (less 10%), within a quarter of the one measured beside it
    assert deadline_s < 1.25 * cold
    assert stalled <= 1.2 * (deadline_s + cold), \
        f"TTFT {stalled:.2f}s with a stalled lender; deadline {deadline_s:.2f}s, cold {cold:.2f}s"
    # No single stall waits on the lender: what a stalled transfer would cost is seconds
    # (Mooncake gives up after 30 s), twice the deadline and a recompute is noise at most.
    for t, d in stalls:
        assert t <= 2 * (d + max(colds)), f"stalls (TTFT, deadline) {stalls}, colds {colds}"
    # b's counters (what `kvtier inspect` shows) name the lender that stalled
    index_path = cluster.policy("b", tiers=("dram",))["index"]["path"]

    def blamed() -> dict:
        ix = Index(index_path, readonly=True, recover=False)
        try:
            return read_counters(ix).get("dram", {}).get("lenders", {})
        finally:
            ix.close()

    wait_for(lambda: any(k != "unknown" and n > 0 for k, n in blamed().items()), 30,
             "b's counters naming the stalled lender")


def test_a_frozen_master_costs_a_lookup_its_recompute_not_a_second_of_the_engine(
        engines, cluster):
    """The pool's master stops answering (SIGSTOP): a cold request's lookup waits for the
    pool at most what recomputing the request costs, off the scheduler's thread, and the
    request is computed (before, the lookup held the scheduler, and every running request
    with it, for the tier's `call_timeout_s` of 1 s)."""
    b = engine(engines, cluster, "b")
    warm = [random_prompt(seed, 2048) for seed in (70, 71, 72)]
    for prompt in warm:  # b times its own prefills: a 512-token one costs it milliseconds
        ttft(b, prompt)
    # b's own calls to the pool are done: the lookup below is the first to meet the freeze
    wait_for(lambda: all(in_pool(cluster, p) for p in warm), 30, "b's saves")
    colds = [ttft(b, random_prompt(seed, 512))[1] for seed in (73, 74, 75)]
    prompt = random_prompt(76, 512)
    os.kill(cluster.master.proc.pid, signal.SIGSTOP)
    try:
        out, frozen = ttft(b, prompt)
    finally:
        os.kill(cluster.master.proc.pid, signal.SIGCONT)
    assert out.token_ids == engines.baseline(prompt, 1).token_ids
    assert out.kv_transfer_params["kvtier"]["hit_tokens"] == {}
    # a fraction of the second the lookup used to hold the engine for (the tier's
    # call_timeout_s), and within a few colds of its own size
    assert frozen < 0.5 and frozen < 4 * max(colds) + 0.1, f"TTFT {frozen:.3f}s, colds {colds}"
    assert "lookup gave up, computing request" in (engines.logs / "b.log").read_text()
