"""The pieces of the engine replay without engines: plans, routers, the local prefix cache
model, the prefill model's fit, metrics and targets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.store.base.errors import KVTierError
from kvtier.tools.replay.cluster import ReplayError, Sizing, configs
from kvtier.tools.replay.experiment import (EngineSpec, build_plan, kv_tokens_for,
                                            run_engine_replay)
from kvtier.tools.replay.metrics import kv_ratio, summarize
from kvtier.tools.replay.plan import PlanSpec, make_plan
from kvtier.tools.replay.prefill_model import PrefillModel, fit
from kvtier.tools.replay.router import make_router
from kvtier.tools.replay.sim import LocalCache
from kvtier.tools.workload.synthetic import SyntheticSpec, synthetic


@pytest.fixture(scope="module")
def plan():
    return build_plan(EngineSpec(turns=5, scale=0.05), 3)


def test_turns_extend_their_session_prompt_and_share_the_system_prompt(plan):
    by_session: dict[int, list[int]] = {}
    for i in range(len(plan)):
        by_session.setdefault(int(plan.session[i]), []).append(i)
    heads = []
    for reqs in by_session.values():
        assert [int(plan.turn[i]) for i in reqs] == list(range(5))
        for a, b in zip(reqs, reqs[1:]):
            pa, pb = plan.prompt(a), plan.prompt(b)
            full = len(plan.chain(a)) * plan.block_tokens
            assert pb[:full] == pa[:full]          # the next turn extends the full blocks
            assert int(plan.next_in_session[a]) == b
        heads.append(plan.prompt(reqs[0])[:1000 // 32 * 32])
    assert all(h == heads[0] for h in heads)       # the shared system prompt
    assert len(plan.prompt(0)) == plan.input_tokens[0]


def test_think_time_is_the_gap_after_the_previous_response():
    work = synthetic(SyntheticSpec(sessions=2, turns=3, block_tokens=32, seed=1))
    p = make_plan(work, PlanSpec(block_tokens=32, max_context=1 << 20), scale=1.0)
    for i in range(len(p)):
        nxt = int(p.next_in_session[i])
        if nxt >= 0:
            # synthetic arrivals are previous arrival + prefill time + gap
            gap = p.arrival_s[nxt] - p.arrival_s[i] - p.input_tokens[i] / 20_000
            assert p.think_s[nxt] == pytest.approx(gap)
    assert sorted(p.first_requests()) == sorted(int(np.flatnonzero(p.turn == 0)[k])
                                                for k in range(2))


def test_max_context_keeps_the_head():
    work = synthetic(SyntheticSpec(sessions=1, turns=4, block_tokens=32))
    p = make_plan(work, PlanSpec(block_tokens=32, max_context=20_000), scale=1.0)
    assert p.input_tokens.max() <= 20_000
    assert p.prompt(3)[:20_000 // 32 * 32] == p.prompt(2)[:20_000 // 32 * 32]


def test_routers():
    rr = make_router("round-robin", 3)
    assert [rr.pick(0, [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    sticky = make_router("session-sticky", 2)
    assert [sticky.pick(s, [0, 0]) for s in (5, 6, 5, 7, 6)] == [0, 1, 0, 0, 1]
    ll = make_router("least-loaded", 3)
    assert ll.pick(0, [2, 1, 1]) == 1
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random", 2)


def test_local_cache_evicts_tails_before_heads():
    c = LocalCache(4)
    c.insert(["a", "b", "c"])
    c.insert(["x", "y"])         # over capacity: c (the oldest tail) goes first
    assert c.match(["a", "b", "c"]) == 2 and c.match(["x", "y"]) == 2
    c.insert(["a", "b", "z"])
    assert c.match(["x", "y"]) == 1  # y, the least recent tail, went next


def test_fit_recovers_the_model():
    true = PrefillModel(0.02, 5e-5, 2e-8, {"mooncake": 3e-6, "sharedfs": 8e-6}, 0.01)
    rng = np.random.default_rng(0)
    pts: dict = {"compute": [], "load": {"mooncake": [], "sharedfs": []}, "decode_s": 0.01}
    for _ in range(40):
        n, c = int(rng.integers(64, 8192)), int(rng.integers(0, 8192))
        pts["compute"].append((n, c, true.ttft(n, c)))
        for kind in ("mooncake", "sharedfs"):
            pts["load"][kind].append((n, c + 1, true.ttft(n, c + 1, {kind: c + 1})))
    got = fit(pts)
    for f in ("t0_s", "a_s", "b_s"):
        assert getattr(got, f) == pytest.approx(getattr(true, f), rel=1e-3)
    assert got.load_s["mooncake"] == pytest.approx(3e-6, rel=1e-3)
    assert got.load_s["nvme"] == got.load_s["sharedfs"]   # not measured: the disk's cost


def test_sizing_refuses_a_small_pool_below_a_segment_and_raises_a_full_one():
    s = Sizing(32 << 10, 40 << 20, 4)
    assert s.segment_bytes(1.5) == 16 << 20
    with pytest.raises(ReplayError, match="--sessions, --turns, --scale"):
        s.segment_bytes(0.25)
    labels = [c.label for c in configs((1.5, 0.25), ("local", "dram-only"))]
    assert labels == ["kvtier@150%", "kvtier@25%", "dram-only@25%", "local"]
    assert [c.label for c in configs((1.5,), ("dram-only",))] == ["kvtier", "dram-only"]


def test_a_pool_too_small_for_a_segment_fails_before_any_engine_starts(tmp_path):
    started = []

    class UI:
        def say(self, msg):
            started.append(msg)

        def phase(self, desc, total):
            started.append(desc)
            return lambda done: None

    spec = EngineSpec(engine="sim", instances=(4,), sessions=2, turns=2, scale=0.01,
                      dram=(1.5, 0.25), baselines=("local",), out=tmp_path)
    with pytest.raises(ReplayError, match="below Mooncake's 16 MiB segment"):
        run_engine_replay(spec, UI())
    assert started == []


def test_kv_cache_holds_the_longest_request_and_a_quarter_of_the_live_contexts(plan):
    max_len, kv = kv_tokens_for(EngineSpec(turns=5, scale=0.05), plan, 2)
    assert max_len >= int((plan.input_tokens + plan.output_tokens).max())
    assert kv >= max_len and kv % 32 == 0


def _rec(i, session, inst, start, end, inp, cached, tiers=None):
    return {"i": i, "session": session, "turn": 0, "instance": inst, "input_tokens": inp,
            "output_tokens": 1, "sent": start, "start": start, "end": end, "ttft": end - start,
            "e2e": end - start, "cached": cached, "tiers": tiers or {}, "saved_chunks": 2}


def test_metrics_split_hits_by_tier_and_count_live_contexts():
    recs = [_rec(0, 0, 0, 0.0, 1.0, 100, 0), _rec(1, 1, 0, 0.5, 2.0, 100, 50, {"dram": 30}),
            _rec(2, 0, 0, 1.5, 3.0, 200, 100, {"shared": 100})]
    s = summarize(recs, ["dram", "shared"], 10, 32, 100)["overall"]
    assert s["hit_rate"] == pytest.approx(100 * 150 / 400)
    assert s["hit_by_tier"] == pytest.approx({"local": 5.0, "dram": 7.5, "shared": 25.0})
    assert s["bytes_read"] == {"dram": 300, "shared": 1000}
    assert s["throughput_tps"] == pytest.approx(403 / 3.0)
    assert s["recomputed_pct"] == 0.0  # records without the field (the sim's)
    recs[2]["recomputed"] = 40  # promised from kvtier, then computed
    assert summarize(recs, ["dram", "shared"], 10, 32, 100)["overall"]["recomputed_pct"] == \
        pytest.approx(100 * 40 / 400)
    recs[1]["declined"] = 20  # found in a tier, computed as the faster way
    assert summarize(recs, ["dram", "shared"], 10, 32, 100)["overall"]["declined_pct"] == \
        pytest.approx(100 * 20 / 400)
    # live on instance 0 at each start: {0}: 1.0, {0,1}: 2.0, {0 (now 200), 1}: 3.0
    assert kv_ratio(recs, 100) == pytest.approx(2.0)


def test_engine_spec_errors_name_the_option():
    for kw, msg in [({"engine": "x"}, "--engine"), ({"chunk_tokens": 48}, "--chunk-tokens"),
                    ({"eviction": "belady"}, "--eviction"), ({"admission": "x"}, "--admission"),
                    ({"pool": "x"}, "--pool")]:
        with pytest.raises(KVTierError, match=msg):
            EngineSpec(**kw).check()


def test_the_pool_is_the_readmes_segment_files_unless_the_tmpfs_cannot_hold_them():
    """`--pool auto` (the default): segment files on one host, the pool service when the
    tmpfs is too small for the engines' files (saying so), TCP across hosts; an explicit
    choice is kept, and `files` that cannot fit is an error naming the fixes."""
    from kvtier.tools.replay.vllm_cluster import choose_pool

    MiB = 1 << 20
    assert choose_pool("auto", 1, 96 * MiB, 24 << 30) == ("files", None)
    pool, why = choose_pool("auto", 1, 96 * MiB, 64 * MiB)  # Docker's default /dev/shm
    assert pool == "service" and "64 MiB free" in why and "96 MiB" in why
    assert choose_pool("auto", 3, 96 * MiB, 24 << 30) == ("embedded", None)
    for pool in ("service", "embedded"):
        assert choose_pool(pool, 1, 96 * MiB, 0) == (pool, None)
    with pytest.raises(ReplayError, match="--shm-size.*--pool service"):
        choose_pool("files", 1, 96 * MiB, 64 * MiB)
    with pytest.raises(ReplayError, match="--pool"):
        choose_pool("tcp", 1, 0, 0)
    assert EngineSpec().pool == "auto"
    EngineSpec(engine="vllm").check()


def sealed_frames(model: str, n: int, payload: int) -> tuple[list[str], list]:
    """`n` block keys of a namespace of `model` and a sealed frame of `payload` bytes each."""
    from kvtier.store.base import block
    from kvtier.store.base.keys import Namespace, block_keys

    keys = block_keys(Namespace(model=model, chunk_tokens=16), range(16 * n))
    frames = []
    for key in keys:
        f = block.alloc_aligned(block.frame_size(payload, block.PAGE))
        block.seal(f, key, payload)
        frames.append(f)
    return keys, frames


def test_engines_of_a_files_pool_copy_each_others_blocks_out_of_their_files(tmp_path,
                                                                          mooncake_master):
    """`--pool files`: each engine lends its share from a file in the run's /dev/shm
    directory, and another engine's load copies the block straight out of that file."""
    import shutil
    import tempfile

    from kvtier.store.base.config import policy_from_dict
    from kvtier.store.tiered import TieredStore
    from kvtier.tools.replay.cluster import Config, node_policy
    from kvtier.tools.replay.vllm_cluster import SEGMENT_TMPFS

    sizing = Sizing(block_bytes=64 << 10, working_set_bytes=64 << 20, instances=2)
    segments = Path(tempfile.mkdtemp(prefix="kvtier-test-replay-", dir=SEGMENT_TMPFS))
    try:
        def policy(node):
            return policy_from_dict(node_policy(
                tmp_path, node, mooncake_master.address, Config("dram-only", 0.5, "dram-only"),
                sizing, 64, "lru", "always", segment_dir=segments))

        assert policy("n0").tiers[0].segment_dir == str(segments)
        payload = 100_000
        keys, frames = sealed_frames("replay-parts-files", 32, payload)
        with TieredStore(policy("n0"), node_id="n0", mover=False) as a, \
                TieredStore(policy("n1"), node_id="n1", mover=False) as b:
            assert len(list(segments.iterdir())) == 2  # one lender's file each
            assert a.save(keys, frames) == [True] * len(keys)
            outs = [memoryview(bytearray(len(f))) for f in frames]
            assert b.load(keys, outs, ["dram"] * len(keys)) == [payload] * len(keys)
            assert all(bytes(o) == bytes(f) for o, f in zip(outs, frames))
            # where b finds them: in a's file, to be read in place
            runs = b.locate(keys, ["dram"] * len(keys))
            assert sum(r.count for r in runs) == len(keys)
        assert list(segments.iterdir()) == []  # the lenders removed their files
    finally:
        shutil.rmtree(segments, ignore_errors=True)


def test_engines_on_one_pool_service_read_its_usage_from_the_master(tmp_path, mooncake_master):
    """The policies the replay gives engines that join one pool service: each reads the
    service segment's usage from the master, so another engine's puts count (counting its
    own puts alone, no engine ever saw the pool fill and the master did all the evicting)."""
    from kvtier.store.base.config import MasterConfig, policy_from_dict
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.mooncake.master import free_port
    from kvtier.tiers.mooncake.service import PoolService
    from kvtier.tools.replay.cluster import Config, node_policy

    sizing = Sizing(block_bytes=64 << 10, working_set_bytes=64 << 20, instances=2)
    address, run = f"127.0.0.1:{free_port()}", tmp_path / "run"

    def policy(node):
        return policy_from_dict(node_policy(
            tmp_path, node, mooncake_master.address, Config("dram-only", 0.5, "dram-only"),
            sizing, 64, "lru", "always", service=address, run_dir=run,
            metrics_port=mooncake_master.metrics_port))

    payload = 200_000
    keys, frames = sealed_frames("replay-parts", 8, payload)
    master = MasterConfig(address=mooncake_master.address, embedded=False, run_dir=run)
    with PoolService(policy("service").tiers[0], master), \
            TieredStore(policy("n0"), node_id="n0", mover=False) as a, \
            TieredStore(policy("n1"), node_id="n1", mover=False) as b:
        a.save(keys, frames)
        pool = b.tiers[0]
        pool.usage.refresh()
        assert pool.client.segment  # found where the service's starter named it
        used = pool.used_bytes()
        assert used >= 8 * payload  # a's puts, read from the master
        assert pool.own_share(used) == 0.0 and a.tiers[0].own_share(used) == 1.0


def test_peer_targets_ask_a_lead_of_30_points_over_a_dram_only_peer_below_the_working_set():
    """The report's peer rows: at least the peer's hit rate with a pool that holds the
    working set; 30 points above a DRAM-only peer with one that does not (said when an
    infinite cache leaves less room); never against a peer with a disk tier of its own;
    TTFT at most and throughput at least the peer's."""
    from kvtier.tools.replay.targets import evaluate

    def cfg(kind, frac, hit, tput=100.0):
        return {"kind": kind, "dram_frac": frac, "overall": {
            "hit_rate": hit, "ttft_p50_s": 0.1, "ttft_p99_s": 1.0, "throughput_tps": tput}}

    run = {"instances": 4, "reuse_bound_pct": 95.3, "configs": {
        "kvtier@150%": cfg("kvtier", 1.5, 95.1), "kvtier@25%": cfg("kvtier", 0.25, 95.0),
        "mooncake-store@150%": cfg("mooncake-store", 1.5, 95.1, tput=120.0),
        "mooncake-store@25%": cfg("mooncake-store", 0.25, 64.0),
        "lmcache@25%": cfg("lmcache", 0.25, 66.0),
        "mooncake-store+ssd@25%": cfg("mooncake-store+ssd", 0.25, 90.0)}}
    rows = {r["what"]: r for r in evaluate({"runs": [run]})}
    assert rows["kvtier@150% hit rate % against mooncake-store@150%"]["ok"]
    assert rows["kvtier@25% hit rate % against mooncake-store@25%"]["ok"]  # 95.0 >= 94.0
    lm = rows["kvtier@25% hit rate % against lmcache@25%"]
    assert not lm["ok"] and lm["target"] == ">= 96.0" and "infinite cache's 95.3%" in lm["note"]
    assert rows["kvtier@25% hit rate % against mooncake-store+ssd@25%"]["target"] == ">= 90.0"
    assert not rows["kvtier@150% throughput / mooncake-store@150%'s"]["ok"]
    assert rows["kvtier@25% throughput / lmcache@25%'s"]["ok"]


def test_a_tmpfs_too_small_for_the_segment_files_gives_the_engines_a_pool_service(
        tmp_path, monkeypatch):
    """A cluster whose /dev/shm cannot hold its engines' shares starts the node's pool
    service for them (its memory is not on the tmpfs), says so with the fix, and makes no
    segment directory; the report names the pool."""
    from kvtier.tools.replay import vllm_cluster
    from kvtier.tools.replay.cluster import Config

    monkeypatch.setattr(vllm_cluster, "tmpfs_free", lambda directory="": 64 << 20)
    said: list[str] = []
    sizing = Sizing(block_bytes=64 << 10, working_set_bytes=256 << 20, instances=2)
    cluster = vllm_cluster.VllmCluster(
        tmp_path, Config("kvtier", 1.5, "kvtier"), 2, tmp_path / "model", sizing,
        chunk_tokens=32, block_size=32, num_blocks=64, max_model_len=1024, dtype="float32",
        eviction="lru", admission="reuse", say=said.append)
    try:
        assert cluster.pool == "service" and cluster.service is not None
        assert cluster.segment_dir is None
        assert all(p["tiers"][0].get("service") for p in cluster.policies)
        assert len(said) == 1 and "64 MiB free" in said[0] and "--shm-size" in said[0]
    finally:
        cluster.close()
