"""Both connector sides driven step by step, without an engine: a real store (sharedfs tier,
LMDB index), a real paged cache in vLLM's CPU layout, and vLLM's data objects written as
plain records (requests, allocated blocks, scheduler outputs: vLLM only reads their fields).

This reaches what a tiny engine rarely does on its own: the final save at request end that
must hold the request's blocks, loads that start inside a local hit, a corrupt chunk in the
middle of a load, a request aborted while its load is queued.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")

from kvtier.connector.config import ConnectorConfig  # noqa: E402
from kvtier.connector.plan.recompute import CLASS_MIN  # noqa: E402
from kvtier.connector.scheduler import SHARE_EVERY_S, SchedulerSide  # noqa: E402
from kvtier.connector.stats import KVTierPromMetrics  # noqa: E402
from kvtier.connector.worker import WorkerSide  # noqa: E402
from kvtier.store.base.config import policy_from_dict  # noqa: E402
from kvtier.store.base.keys import block_keys  # noqa: E402
from kvtier.tools.vllm_engine import random_prompt  # noqa: E402

from conftest import matched, wait_until  # noqa: E402
from engine_util import files_of  # noqa: E402

BS, CHUNK, NB, L, H, D = 32, 64, 128, 2, 2, 64
M = CHUNK // BS
TOOL = 99_001  # a token id standing for the model's tool-call token


def make_sides(root, tiers: list[dict], staging: int = 1 << 20, master: str | None = None,
               model_config=None, load_deadline: bool = False):
    """Both sides over one store of `tiers` and a paged cache in vLLM's CPU layout. Loads
    without deadlines unless asked: with no engine the recompute model learns from the
    test's own pacing of steps, and a busy host would turn a slow load into a recompute
    (`test_deadline` checks deadlines on a real engine)."""
    policy = policy_from_dict({
        "namespace": {"model": "unit"}, "chunk_tokens": CHUNK,
        "index": {"path": str(root / "index"), "map_size": "32MiB"}, "tiers": tiers,
        **({"master": {"address": master, "embedded": False}} if master else {})})
    spec = vllm_kv.FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D,
                                     dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    layout = vllm_kv.KVCacheLayout.LBHNC
    layer_stride, block_stride, *_ = vllm_kv.compute_layout_strides(spec, NB, L, layout)
    tensor = vllm_kv.KVCacheTensor(size=L * NB * spec.page_size_bytes, layers=names,
                                   layer_stride=layer_stride, block_stride=block_stride)
    kvc = vllm_kv.KVCacheConfig(num_blocks=NB, kv_cache_tensors=[tensor],
                                kv_cache_groups=[vllm_kv.KVCacheGroupSpec(names, spec)])
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    caches = dict(zip(names, vllm_kv.create_kv_cache_views(raw, spec, NB, layout, tensor)))
    for view in caches.values():
        view.copy_(torch.randn(view.shape).to(torch.bfloat16))
    vconf = SimpleNamespace(model_config=model_config or SimpleNamespace(model="/m"),
                            parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                            pipeline_parallel_size=1),
                            scheduler_config=SimpleNamespace(max_num_batched_tokens=8192))
    cfg = ConnectorConfig(policy, "unit", staging, 2, "async", load_deadline=load_deadline)
    worker = WorkerSide(vconf, kvc, cfg)  # first, as vLLM builds them in one process
    sched = SchedulerSide(vconf, kvc, cfg)
    worker.register_kv_caches(caches)
    return SimpleNamespace(sched=sched, worker=worker, caches=caches, root=root)


def close_sides(s) -> None:
    s.worker.shutdown()
    s.sched.shutdown()


def shared_sides(root, **kw):
    """Both sides over one sharedfs tier under `root` (`make_sides`' keywords)."""
    return make_sides(root, [{"name": "shared", "kind": "sharedfs",
                              "path": str(root / "shared"), "capacity": "64MiB"}], **kw)


@pytest.fixture
def sides(tmp_path):
    s = shared_sides(tmp_path)
    yield s
    close_sides(s)


def request(req_id: str, tokens: list[int], computed: int = 0, **kw):
    return SimpleNamespace(request_id=req_id, all_token_ids=list(tokens),
                           num_tokens=len(tokens), num_prompt_tokens=len(tokens),
                           num_computed_tokens=computed,
                           prompt_embeds=None, lora_request=None, cache_salt=None,
                           mm_features=[], kv_transfer_params=kw.get("params"))


def blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def step(sched, new=(), scheduled=None):
    """A scheduler output with `new` = [(req_id, block_ids, num_computed_tokens)]."""
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),),
                                            num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens=scheduled or {})
    return sched.build_connector_meta(out)


def run_worker(worker, meta, finished=frozenset(), idle=False):
    worker.start_load_kv(meta, idle)
    worker.wait_for_save(meta)
    deadline = time.monotonic() + 10
    while not worker.io.idle() and time.monotonic() < deadline:
        time.sleep(0.005)
    return worker.get_finished(set(finished))


def blocks_of(caches, ids):
    return [v[list(ids)].clone() for v in caches.values()]


def save_prompt(s, req_id, tokens, ids):
    r = request(req_id, tokens)
    assert matched(s.sched, r, 0) == (0, False)
    s.sched.update_state_after_alloc(r, blocks(ids), 0)
    meta = step(s.sched, [(req_id, ids, 0)], {req_id: len(tokens)})
    assert [len(j.keys) for j in meta.saves] == [len(tokens) // CHUNK]
    run_worker(s.worker, meta)
    r.num_computed_tokens = len(tokens)
    assert s.sched.request_finished(r, (ids,))[0] is False  # all saved in-step: no hold
    return r


def load_into(s, req_id, tokens, ids, local=0, tiers=None):
    r = request(req_id, tokens)
    n, is_async = matched(s.sched, r, local)
    assert is_async and n > 0
    s.sched.update_state_after_alloc(r, blocks(ids), n)
    meta = step(s.sched)
    # where the lookup found each chunk rides along, so the load asks that tier first
    assert [t for job in meta.loads for t in job.tiers] == (
        tiers or ["shared"] * sum(len(job.keys) for job in meta.loads))
    sending, recving = run_worker(s.worker, meta)
    while not recving:
        sending, recving = s.worker.get_finished(set())
    assert recving == {req_id}
    report_loads(s)
    return r, n


def report_loads(s):
    """What vLLM does after each step: the workers' metadata to the scheduler side."""
    s.sched.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=s.worker.build_worker_meta()))


def save_with_a_corrupt_chunk(s, tokens, bad: int) -> list[str]:
    """Save `tokens` as request r1 (blocks 0-9), then flip one payload bit of chunk `bad`'s
    file; returns the chunk keys."""
    save_prompt(s, "r1", tokens, list(range(0, 10)))
    keys = block_keys(s.sched.ns, tokens, b"")
    path = files_of(s.root / "shared", [keys[bad]])[0]
    data = bytearray(path.read_bytes())
    data[-7] ^= 1
    path.write_bytes(bytes(data))
    return keys


def test_save_then_load_into_other_blocks(sides):
    tokens = random_prompt(1, 300)
    src, dst = list(range(0, 10)), list(range(20, 30))
    save_prompt(sides, "r1", tokens, src)
    _, n = load_into(sides, "r2", tokens + [5], dst)
    assert n == 4 * CHUNK  # the whole chunks; 300 tokens hold 4 (and leave one to compute)
    assert sides.worker.get_block_ids_with_load_errors() == set()
    for a, b in zip(blocks_of(sides.caches, src[:8]), blocks_of(sides.caches, dst[:8])):
        assert torch.equal(a, b)
    assert not any(torch.equal(a, b) for a, b in zip(blocks_of(sides.caches, src[8:9]),
                                                      blocks_of(sides.caches, dst[8:9])))
    worker_stats, sched_stats = sides.worker.get_stats(), sides.sched.get_stats()
    assert worker_stats.data["counters"]["load_chunks"] == 4
    assert worker_stats.data["counters"]["save_chunks"] == 4
    assert worker_stats.data["counters"]["load_bytes"] == 4 * M * L * H * BS * 2 * D * 2
    assert sched_stats.data["counters"]["hit_tokens:shared"] == 4 * CHUNK
    merged = worker_stats.aggregate(sched_stats).reduce()
    assert merged["load_chunks"] == 4 and merged["load_ms_avg"] > 0
    assert sides.worker.get_stats() is None  # taken: the next interval starts empty


def test_saves_stuck_behind_a_tier_drop_new_ones_instead_of_holding_the_step(sides):
    """Every staging buffer held by saves that do not end (a put to a frozen master waits
    30 s): a step waits for one at most `SAVE_WAIT_S`, the steps after it not at all, and
    the chunks they would have saved are counted as dropped; once a buffer frees, saves
    land again."""
    from kvtier.connector.worker import SAVE_WAIT_S
    pool = sides.worker.main.save_pool
    held = [pool.acquire() for _ in range(pool.max_buffers)]
    try:
        waits = []
        for i in range(3):
            tokens = random_prompt(90 + i, 2 * CHUNK)
            r = request(f"s{i}", tokens)
            assert matched(sides.sched, r, 0) == (0, False)
            ids = list(range(10 * i, 10 * i + 4))
            sides.sched.update_state_after_alloc(r, blocks(ids), 0)
            meta = step(sides.sched, [(r.request_id, ids, 0)], {r.request_id: len(tokens)})
            t0 = time.monotonic()
            saving = threading.Thread(target=sides.worker.wait_for_save, args=(meta,),
                                      daemon=True)
            saving.start()
            saving.join(SAVE_WAIT_S + 5)  # a step that waits on them would wait 30 s
            assert not saving.is_alive(), "the step waits for saves that do not end"
            waits.append(time.monotonic() - t0)
        assert SAVE_WAIT_S * 0.9 <= waits[0] < SAVE_WAIT_S + 3.0, waits
        assert max(waits[1:]) < 0.5, waits  # stuck: the later steps do not wait
        counters = sides.worker.get_stats().data["counters"]
        assert counters["save_dropped_chunks"] == 3 * 2 and "save_chunks" not in counters
    finally:
        for buf in held:
            pool.release(buf)
    tokens = random_prompt(99, 2 * CHUNK)
    save_prompt(sides, "after", tokens, [40, 41, 42, 43])
    counters = sides.worker.get_stats().data["counters"]
    assert counters["save_chunks"] == 2 and "save_dropped_chunks" not in counters


def test_stats_reach_prometheus():
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    reg = CollectorRegistry()
    types = {cls: partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"],
                             {0: ["0"]})
    prom.observe({"counters": {"hit_tokens:dram": 512, "load_bytes": 1 << 20,
                               "load_in_place_chunks": 16},
                  "ms": {"load": [4.0, 6.0], "save": []}})
    assert reg.get_sample_value("kvtier_hit_tokens_total",
                                {"engine": "0", "tier": "dram"}) == 512
    assert reg.get_sample_value("kvtier_load_bytes_total", {"engine": "0"}) == 1 << 20
    assert reg.get_sample_value("kvtier_load_in_place_chunks_total", {"engine": "0"}) == 16
    assert reg.get_sample_value("kvtier_load_seconds_count", {"engine": "0"}) == 2


def test_requests_larger_than_a_staging_buffer_move_in_several_batches(sides):
    tokens = random_prompt(8, 1300)  # 20 chunks of 68 KiB frames; a 1 MiB buffer holds 15
    assert sides.worker.main.save_pool.capacity < 20
    src, dst = list(range(0, 41)), list(range(60, 101))
    save_prompt(sides, "r1", tokens, src)
    _, n = load_into(sides, "r2", tokens, dst)
    assert n == 20 * CHUNK and sides.worker.get_block_ids_with_load_errors() == set()
    for a, b in zip(blocks_of(sides.caches, src[:40]), blocks_of(sides.caches, dst[:40])):
        assert torch.equal(a, b)


def test_load_starting_inside_a_local_hit_keeps_the_local_blocks(sides):
    tokens = random_prompt(2, 300)
    save_prompt(sides, "r1", tokens, list(range(0, 10)))
    dst = list(range(30, 40))
    before = blocks_of(sides.caches, dst[2:3])
    _, n = load_into(sides, "r2", tokens, dst, local=3 * BS)  # 3 blocks held locally
    assert n == 4 * CHUNK - 3 * BS
    assert all(torch.equal(a, b) for a, b in zip(before, blocks_of(sides.caches, dst[2:3])))
    for a, b in zip(blocks_of(sides.caches, [3, 4, 5, 6, 7]),
                    blocks_of(sides.caches, dst[3:8])):
        assert torch.equal(a, b)


def test_chunks_held_locally_are_not_looked_for(sides):
    tokens = random_prompt(7, 300)
    save_prompt(sides, "r1", tokens, list(range(0, 10)))
    keys = block_keys(sides.sched.ns, tokens, b"")
    sides.sched.store.by_name["shared"].delete([keys[0]])  # kvtier lost what vLLM still has
    dst = list(range(60, 70))
    _, n = load_into(sides, "r2", tokens, dst, local=CHUNK)
    assert n == 3 * CHUNK  # the chunks past the local hit, though kvtier lacks the first
    for a, b in zip(blocks_of(sides.caches, range(2, 8)), blocks_of(sides.caches, dst[2:8])):
        assert torch.equal(a, b)


def test_corrupt_chunk_fails_its_blocks_and_every_later_one(sides):
    tokens = random_prompt(3, 300)
    save_with_a_corrupt_chunk(sides, tokens, 2)
    dst = list(range(40, 50))
    load_into(sides, "r2", tokens, dst)
    assert sides.worker.get_block_ids_with_load_errors() == set(dst[4:8])
    for a, b in zip(blocks_of(sides.caches, [0, 1, 2, 3]), blocks_of(sides.caches, dst[:4])):
        assert torch.equal(a, b)


def test_final_save_at_request_end_holds_the_blocks_until_gathered(sides):
    tokens = random_prompt(4, 140)
    ids = list(range(0, 5))
    r = request("r1", tokens[:127])  # async scheduling: token 127's id not known yet
    matched(sides.sched, r, 0)
    sides.sched.update_state_after_alloc(r, blocks(ids), 0)
    meta = step(sides.sched, [("r1", ids, 0)], {"r1": 130})
    assert [len(j.keys) for j in meta.saves] == [1]  # chunk 1 is computed, not yet keyable
    run_worker(sides.worker, meta)
    r.all_token_ids, r.num_tokens, r.num_computed_tokens = tokens[:131], 131, 130
    hold, params = sides.sched.request_finished(r, (ids,))
    assert hold and params == {"kvtier": {"hit_tokens": {}, "recomputed_tokens": 0,
                                          "declined_tokens": 0, "load_deadlines_ms": [], "saved_chunks": 2,
                                          "loads": {"async": 0, "sync": 0}}}
    meta = step(sides.sched)
    assert meta.hold == ["r1"] and [len(j.keys) for j in meta.saves] == [1]
    sending, _ = run_worker(sides.worker, meta, finished={"r1"})
    assert sending == {"r1"}  # released once the chunk is out of the blocks
    assert run_worker(sides.worker, step(sides.sched))[0] is None  # reported once


class _Positive:
    def __eq__(self, other):
        return isinstance(other, float) and other > 0


ANY_DEADLINE = _Positive()


@pytest.fixture
def deadline_sides(tmp_path):
    s = shared_sides(tmp_path, load_deadline=True)
    yield s
    close_sides(s)


def test_a_hit_slower_to_load_than_to_compute_is_declined_and_said_so(deadline_sides):
    """A tier measured far slower than this engine's prefill: the lookup promises nothing,
    and the request's end reports the found tokens as declined (not as hits, nor as
    promised and recomputed)."""
    sides = deadline_sides
    tokens = random_prompt(6, 300)
    save_prompt(sides, "r1", tokens, list(range(0, 10)))
    rates = sides.sched.store._deadlines.rates
    for _ in range(20):  # 1 MiB took 10 s, again and again
        rates.observe("shared", 1 << 20, 10.0)
    assert rates.predict("shared", 4 * CHUNK * 1024) > 1.0  # 4 chunks of 64 KiB: > 1 s
    r = request("r2", tokens)
    n, _ = matched(sides.sched, r, 0)
    assert n == 0
    r.num_computed_tokens = 300
    sides.sched.update_state_after_alloc(r, blocks(range(50, 60)), 0)
    step(sides.sched, [("r2", list(range(50, 60)), 0)], {"r2": 300})
    _, params = sides.sched.request_finished(r, (list(range(50, 60)),))
    kv = params["kvtier"]
    assert kv["declined_tokens"] == 4 * CHUNK  # the 4 whole chunks found
    assert kv["hit_tokens"] == {} and kv["recomputed_tokens"] == 0
    assert sides.sched.get_stats().data["counters"]["declined_tokens"] == 4 * CHUNK


def _a_step(sched, steps=()):
    """The engine's step ends: `steps` (tokens, attention work, seconds) its forwards took."""
    meta = SimpleNamespace(steps=list(steps), settled=())
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))


def test_an_engine_publishes_its_prefill_model_in_the_step_it_first_has_one(deadline_sides):
    sched = deadline_sides.sched
    _a_step(sched)  # a step with nothing to share yet: the next read is a second away
    assert sched.store.node_prefill(sched._prefill_kind) == []
    _a_step(sched, [(2048.0, 2048.0 * 1024, 0.2)] * CLASS_MIN)  # chunks of a cold prompt
    assert sched.recompute.shareable
    (row,) = sched.store.node_prefill(sched._prefill_kind)  # this step, not a second later
    assert row["prefills"] == CLASS_MIN


def test_an_idle_engine_plans_a_hit_with_the_model_another_engine_published_meanwhile(
        deadline_sides):
    """An engine that only serves hits steps, then idles while another engine of the node
    times its first prefills and publishes its model; the next hit's deadline is that
    model's recompute, not the slow prior's."""
    s = deadline_sides
    tokens = random_prompt(9, 300)
    save_prompt(s, "r1", tokens, list(range(0, 10)))
    _a_step(s.sched)  # it read the node's models: none yet
    prior_s = s.sched.recompute.predict(4 * CHUNK)
    assert prior_s > 0.1  # the slow prior: 2,000 tokens/s
    s.sched.store.publish_prefill(s.sched._prefill_kind,
                                  {"coef": [0.002, 7e-5, 0.0], "prefills": CLASS_MIN})
    s.sched._prefill_shared -= SHARE_EVERY_S  # idle since: a second without a step
    r = request("r2", tokens)
    n, _ = matched(s.sched, r, 0)
    assert n == 4 * CHUNK
    s.sched.update_state_after_alloc(r, blocks(range(20, 30)), n)
    (job,) = step(s.sched).loads
    # the other engine's 20 ms for these 256 tokens, less the margin: not the prior's 130
    assert job.deadline_s == pytest.approx(0.9 * (0.002 + 256 * 7e-5), rel=0.01)


def promised(s, seed: int, dst: list[int]):
    """Save a 300-token prompt as r1 (blocks 0-9), then look it up as r2 and allocate `dst`
    for the hit; (r2, the tokens promised)."""
    tokens = random_prompt(seed, 300)
    save_prompt(s, "r1", tokens, list(range(0, 10)))
    r = request("r2", tokens)
    n, _ = matched(s.sched, r, 0)
    s.sched.update_state_after_alloc(r, blocks(dst), n)
    return r, n


def test_a_load_carries_its_grace_from_the_plan(deadline_sides):
    promised(deadline_sides, 8, list(range(20, 30)))
    (job,) = step(deadline_sides.sched).loads
    assert 0 < job.grace_s <= job.deadline_s


@pytest.mark.parametrize("grace_s", [5.0, 0.0])
def test_a_load_that_starts_past_its_deadline_gets_its_grace_from_its_start(sides, grace_s):
    """A load that waited out its deadline in the I/O thread's queue (here: given one that
    has passed) still loads what lies there within its grace; with none, it is recomputed."""
    src, dst = list(range(0, 10)), list(range(20, 30))
    promised(sides, 9, dst)
    meta = step(sides.sched)
    meta.loads[:] = [replace(job, deadline_s=-1.0, grace_s=grace_s) for job in meta.loads]
    _, recving = run_worker(sides.worker, meta)
    wait_until(lambda: recving or sides.worker.get_finished(set())[1], 10, "the load to end")
    counters = sides.worker.get_stats().data["counters"]
    failed = sides.worker.get_block_ids_with_load_errors()
    if grace_s:
        assert failed == set() and counters["load_chunks"] == 4
        assert counters["load_late_starts"] == 1 and "load_late_chunks" not in counters
        for a, b in zip(blocks_of(sides.caches, src[:8]), blocks_of(sides.caches, dst[:8])):
            assert torch.equal(a, b)
    else:
        assert failed == set(dst[:8]) and counters["load_late_chunks"] == 4
        assert "load_late_starts" not in counters


def slowed(sides, delay_s: float) -> None:
    """Every read of the worker's store takes `delay_s` longer (a lender starved of CPU)."""
    deadlines = sides.worker.io.store._deadlines
    inner = deadlines._load

    def load(*args):
        time.sleep(delay_s)
        return inner(*args)
    deadlines._load = load


def test_a_load_that_lands_after_its_deadline_but_before_the_engine_collects_counts(sides):
    """An async load's failure reaches the scheduler only when the engine collects; one
    that lands past its deadline but before then is a hit, not a recompute."""
    src, dst = list(range(0, 10)), list(range(20, 30))
    promised(sides, 11, dst)
    meta = step(sides.sched)
    meta.loads[:] = [replace(job, deadline_s=0.1, grace_s=0.0) for job in meta.loads]
    slowed(sides, 0.15)  # past the deadline, within one more deadline's length
    _, recving = run_worker(sides.worker, meta)  # collects once the I/O thread is idle
    assert recving == {"r2"}
    counters = sides.worker.get_stats().data["counters"]
    assert sides.worker.get_block_ids_with_load_errors() == set()
    assert counters["load_chunks"] == 4 and "load_late_chunks" not in counters
    for a, b in zip(blocks_of(sides.caches, src[:8]), blocks_of(sides.caches, dst[:8])):
        assert torch.equal(a, b)


def test_a_load_past_its_deadline_is_cut_when_the_engine_collects(sides):
    """The engine's steps go on meanwhile: the first collection after the deadline cuts the
    load, and its blocks are reported failed in that same collection."""
    dst = list(range(20, 30))
    promised(sides, 12, dst)
    meta = step(sides.sched)
    meta.loads[:] = [replace(job, deadline_s=0.1, grace_s=0.0) for job in meta.loads]
    slowed(sides, 2.0)
    sides.worker.start_load_kv(meta, False)
    t0 = time.monotonic()
    recving = None
    while not recving and time.monotonic() - t0 < 5:  # steps of 20 ms
        time.sleep(0.02)
        recving = sides.worker.get_finished(set())[1]
    took = time.monotonic() - t0
    assert recving == {"r2"} and 0.1 <= took < 1.0, took
    assert sides.worker.get_block_ids_with_load_errors() == set(dst[:8])
    assert sides.worker.get_stats().data["counters"]["load_late_chunks"] == 4


def test_request_aborted_while_loading_saves_nothing_and_holds_nothing(deadline_sides):
    sides = deadline_sides
    r, n = promised(sides, 5, list(range(50, 60)))
    r.num_computed_tokens = n  # vLLM sets it at allocation, before the load lands
    # Nothing was loaded into a request that never ran: no hit is counted (nor recomputed).
    assert sides.sched.request_finished(r, (list(range(50, 60)),)) == \
        (False, {"kvtier": {"hit_tokens": {}, "recomputed_tokens": 0,
                            "declined_tokens": 0, "load_deadlines_ms": [ANY_DEADLINE], "saved_chunks": 0,
                            "loads": {"async": 1, "sync": 0}}})
    meta = step(sides.sched)
    assert len(meta.loads) == 1 and not meta.saves and not meta.hold
    _, recving = run_worker(sides.worker, meta)
    while not recving:  # the load still completes and is reported (vLLM frees then)
        _, recving = sides.worker.get_finished(set())
    assert recving == {"r2"}


def test_session_hints_reach_the_store_and_later_turns_are_inferred(sides):
    from kvtier.store.sessions.persist import read_sessions
    turn1 = random_prompt(6, 300)
    hint = {"kvtier": {"session_id": "agent-7", "expected_gap_s": 3.0}}
    for req_id, tokens, params in (("t1", turn1, hint), ("t2", turn1 + random_prompt(7, 200),
                                                        None)):
        r = request(req_id, tokens, params=params)
        matched(sides.sched, r, 0)
        ids = list(range(len(tokens) // BS + 1))
        sides.sched.update_state_after_alloc(r, blocks(ids), 0)
        run_worker(sides.worker, step(sides.sched, [(req_id, ids, 0)], {req_id: len(tokens)}))
        r.num_computed_tokens = len(tokens)
        sides.sched.request_finished(r, (ids,))
        sides.sched.store.flush_sessions()  # rows are written off the engine's thread
        chains = {sid: chain for sid, _, chain in read_sessions(sides.sched.store.index)}
        assert set(chains) == {"agent-7"}  # the second turn was attached without a hint
        assert len(chains["agent-7"]) == (len(tokens) - 1) // CHUNK


def test_a_turn_ending_on_a_tool_call_is_learned_as_a_tool_wait(sides):
    """With the model's tool-call tokens configured, each turn's end tells the store what the
    session waits for, here and (forwarded) in the workers' store."""
    import pickle

    from kvtier.store.sessions.persist import read_sessions
    sides.sched.tool_call_ids = frozenset({TOOL})
    for forward, req_id, out, want in ((False, "g1", [3, TOOL, 4], "tool"),
                                       (True, "g2", [3, 4], "user")):
        sides.sched.forward = forward
        tokens = random_prompt(9 + forward, 300)
        r = request(req_id, tokens, params={"kvtier": {"session_id": req_id}})
        matched(sides.sched, r, 0)
        ids = list(range(len(tokens) // BS + 1))
        sides.sched.update_state_after_alloc(r, blocks(ids), 0)
        run_worker(sides.worker, step(sides.sched, [(req_id, ids, 0)], {req_id: len(tokens)}))
        r.num_computed_tokens, r.output_token_ids = len(tokens), out
        sides.sched.request_finished(r, (ids,))
        store = sides.sched.store
        if forward:
            meta = step(sides.sched)
            assert [(e.kind, e.hint.gap_class) for e in meta.events] == [("finish", want)]
            run_worker(sides.worker, pickle.loads(pickle.dumps(meta)))
            store = sides.worker.store
        assert store.placement.sessions._sessions[req_id].cls == want
        # and operators see it (`inspect sessions` reads this row)
        store.flush_sessions()
        assert {sid: rec for sid, rec, _ in read_sessions(store.index)}[req_id][
            "waits_for"] == want


def test_by_default_the_scheduler_reads_the_tool_call_tokens_from_the_tokenizer(tmp_path):
    """`tool_call_token_ids: auto` (the default): the ids come from the served model's
    tokenizer, as vLLM's own model config names it."""
    from vllm.config import ModelConfig

    from engine_util import make_tiny_model, save_tokenizer
    model = make_tiny_model(tmp_path / "model")
    vocab = save_tokenizer(model, ["<tool_call>", "</tool_call>"])
    s = shared_sides(tmp_path, model_config=ModelConfig(model=str(model), dtype="bfloat16"))
    try:
        assert s.sched.tool_call_ids == {vocab["<tool_call>"]}
    finally:
        close_sides(s)


def test_with_the_workers_elsewhere_lookups_and_turn_ends_reach_their_store(sides):
    """A scheduler process without a mover (`vllm serve`, multiprocess executor) forwards its
    lookups and turn ends: the store that evicts and prefetches learns the session there."""
    import pickle

    from kvtier.store.sessions.persist import read_sessions
    sides.sched.forward = True  # as in a scheduler process whose store runs no mover
    tokens = random_prompt(8, 300)
    r = request("f1", tokens, params={"kvtier": {"session_id": "agent-9",
                                                 "expected_gap_s": 2.0}})
    matched(sides.sched, r, 0)
    matched(sides.sched, r, 0)  # vLLM asks again while it cannot place it
    ids = list(range(len(tokens) // BS + 1))
    sides.sched.update_state_after_alloc(r, blocks(ids), 0)
    meta = step(sides.sched, [("f1", ids, 0)], {"f1": len(tokens)})
    assert [(e.kind, e.hint.session_id, e.hint.expected_gap_s) for e in meta.events] == [
        ("lookup", "agent-9", 2.0)]
    run_worker(sides.worker, pickle.loads(pickle.dumps(meta)))  # it crosses processes
    r.num_computed_tokens = len(tokens)
    sides.sched.request_finished(r, (ids,))
    # the turn ended with the engine's last request: it must step once more to tell
    assert sides.sched.has_pending_push_work()
    sides.worker.store.flush_sessions()
    assert "agent-9" not in {sid for sid, _, _ in read_sessions(sides.worker.store.index)}
    meta = step(sides.sched)
    assert not sides.sched.has_pending_push_work()
    assert [e.kind for e in meta.events] == ["finish"]
    run_worker(sides.worker, pickle.loads(pickle.dumps(meta)))
    sides.worker.store.flush_sessions()
    rows = {sid: (rec, chain) for sid, rec, chain in read_sessions(sides.worker.store.index)}
    rec, chain = rows["agent-9"]
    chunks = (len(tokens) - 1) // CHUNK
    assert len(chain) == chunks
    assert rec["blocks_per_tier"] == {"shared": chunks}  # the blocks its worker saved
    assert rec["turns"] == 1


def load_now(s, req_id, tokens, ids):
    """A lookup that `load: auto` answers with a synchronous load, scheduled in this step;
    returns (tokens loaded, the step's metadata) once `start_load_kv` returned."""
    r = request(req_id, tokens)
    n, is_async = matched(s.sched, r, 0)
    assert n > 0 and not is_async
    s.sched.update_state_after_alloc(r, blocks(ids), n)
    meta = step(s.sched, [(req_id, ids, n)], {req_id: len(tokens) - n})
    assert [j.sync for j in meta.loads] == [True] and not meta.saves
    s.worker.start_load_kv(meta)
    return n, meta


def test_with_nothing_else_running_auto_loads_before_the_steps_forward(sides):
    sides.sched.load_mode = "auto"
    tokens = random_prompt(9, 300)
    src, dst = list(range(0, 10)), list(range(20, 30))
    save_prompt(sides, "r1", tokens, src)
    n, _ = load_now(sides, "r2", tokens + [5], dst)
    assert n == 4 * CHUNK
    # done when start_load_kv returns: the forward that follows reads these blocks
    for a, b in zip(blocks_of(sides.caches, src[:8]), blocks_of(sides.caches, dst[:8])):
        assert torch.equal(a, b)
    assert sides.worker.get_finished(set()) == (None, None)  # its request is running already
    assert sides.worker.get_block_ids_with_load_errors() == set()
    assert sides.worker.get_stats().data["counters"]["load_chunks"] == 4


def test_auto_loads_in_the_background_while_other_requests_run(sides):
    sides.sched.load_mode = "auto"
    tokens = random_prompt(10, 300)
    save_prompt(sides, "r1", tokens, list(range(0, 10)))
    busy = request("busy", random_prompt(11, 40))
    matched(sides.sched, busy, 0)
    sides.sched.update_state_after_alloc(busy, blocks([60, 61]), 0)
    step(sides.sched, [("busy", [60, 61], 0)], {"busy": 40})  # now running
    r = request("r2", tokens)
    assert matched(sides.sched, r, 0) == (4 * CHUNK, True)
    busy.num_computed_tokens = 40
    sides.sched.request_finished(busy, ([60, 61],))
    assert matched(sides.sched, r, 0) == (4 * CHUNK, False)


def test_a_corrupt_chunk_in_a_synchronous_load_fails_its_blocks_in_the_same_step(sides):
    sides.sched.load_mode = "sync"
    tokens = random_prompt(12, 300)
    keys = save_with_a_corrupt_chunk(sides, tokens, 1)
    dst = list(range(40, 50))
    load_now(sides, "r2", tokens, dst)
    assert sides.worker.get_finished(set()) == (None, None)
    assert sides.worker.get_block_ids_with_load_errors() == set(dst[2:8])
    for a, b in zip(blocks_of(sides.caches, [0, 1]), blocks_of(sides.caches, dst[:2])):
        assert torch.equal(a, b)
    # vLLM truncates the running request at the first bad block and recomputes the rest in
    # the next step: what it recomputes is saved again
    out = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["r2"], resumed_req_ids=set(),
                                              new_block_ids=[None], num_computed_tokens=[CHUNK]),
        num_scheduled_tokens={"r2": len(tokens) - CHUNK})
    meta = sides.sched.build_connector_meta(out)
    assert [(j.keys, j.block_ids) for j in meta.saves] == [
        (keys[1:4], [dst[2:4], dst[4:6], dst[6:8]])]


# ---- reads in place from a pool segment lent from a file ---------------------------------

@pytest.fixture
def pool_sides(tmp_path, mooncake_master):
    """A pool tier lent from a segment file (`segment_dir`) over sharedfs: loads read the
    pool's chunks where they lie in the file and scatter them from there. Loads without
    deadlines: these tests count which chunks were read where and read again, and a busy
    host would turn a slow re-read into a recompute."""
    s = make_sides(tmp_path, [
        {"name": "dram", "kind": "mooncake", "capacity": "64MiB", "buffer": "8MiB",
         "staging": "8MiB", "segment_dir": str(tmp_path / "shm")},
        {"name": "shared", "kind": "sharedfs", "path": str(tmp_path / "shared"),
         "capacity": "64MiB"}], staging=4 << 20, master=mooncake_master.address)
    yield s
    close_sides(s)


def in_place(s) -> int:
    return s.worker.store.by_name["dram"].counters()["in_place"]


def test_pool_chunks_are_scattered_from_the_segment_file_without_a_copy(pool_sides):
    s = pool_sides
    tokens = random_prompt(11, 1300)  # 20 chunks
    src, dst = list(range(0, 41)), list(range(60, 101))
    save_prompt(s, "r1", tokens, src)
    _, n = load_into(s, "r2", tokens, dst, local=3 * BS, tiers=["dram"] * 19)
    assert n == 20 * CHUNK - 3 * BS and s.worker.get_block_ids_with_load_errors() == set()
    assert in_place(s) == 19  # the chunk starting inside the local hit too
    assert s.worker.get_stats().data["counters"]["load_in_place_chunks"] == 19
    for a, b in zip(blocks_of(s.caches, range(3, 40)), blocks_of(s.caches, dst[3:40])):
        assert torch.equal(a, b)
    assert not any(torch.equal(a, b) for a, b in zip(blocks_of(s.caches, src[2:3]),
                                                      blocks_of(s.caches, dst[2:3])))


@pytest.mark.parametrize("where", ["in the cache", "in a copy"])
def test_a_chunk_read_torn_in_place_is_caught_in_the_cache_and_loaded_again(pool_sides, where):
    """What is checked is what the cache holds after the scatter: a chunk whose bytes came
    out wrong there (a frame that changed while it was read, whole again by the check) is
    loaded again the usual way, and no block is reported with the wrong bytes. Checksummed
    where the blocks lie (this layout's pages are contiguous), or in a gathered copy (the
    way for layouts whose pages are not)."""
    s = pool_sides
    tokens = random_prompt(14, 1300)
    src, dst = list(range(0, 41)), list(range(60, 101))
    save_prompt(s, "r1", tokens, src)
    paged, scatter = s.worker.io.paged, s.worker.io.paged.scatter
    assert paged._spans is not None
    if where == "in a copy":
        paged._spans = None
    torn = []

    def scatter_torn(ids, rows, skip_first=0):  # the first scatter is the in-place one
        scatter(ids, rows, skip_first)
        if not torn:
            page = s.caches["model.layers.0.self_attn.attn"][dst[5 * M]]
            at = (0,) * page.dim()
            page[at] += 1.0
            torn.append(at)
    paged.scatter = scatter_torn
    try:
        _, n = load_into(s, "r2", tokens, dst, tiers=["dram"] * 20)
    finally:
        del paged.scatter
    assert torn and n == 20 * CHUNK and s.worker.get_block_ids_with_load_errors() == set()
    assert in_place(s) == 19  # chunk 5 failed the check and was read again
    assert s.worker.get_stats().data["counters"]["load_in_place_chunks"] == 19
    for a, b in zip(blocks_of(s.caches, src[:40]), blocks_of(s.caches, dst[:40])):
        assert torch.equal(a, b)


def test_a_chunk_found_below_the_pool_splits_the_in_place_runs(pool_sides):
    s = pool_sides
    tokens = random_prompt(12, 1300)
    save_prompt(s, "r1", tokens, list(range(0, 41)))
    keys = block_keys(s.sched.ns, tokens, b"")
    store = s.worker.store
    wait_until(lambda: all(store.by_name["shared"].contains(keys)), 10, "persisted")
    assert store.by_name["dram"].delete([keys[10]]) == 1
    dst = list(range(60, 101))
    load_into(s, "r2", tokens, dst, tiers=["dram"] * 10 + ["shared"] + ["dram"] * 9)
    assert s.worker.get_block_ids_with_load_errors() == set()
    assert in_place(s) == 19
    for a, b in zip(blocks_of(s.caches, range(0, 40)), blocks_of(s.caches, dst[:40])):
        assert torch.equal(a, b)


def test_a_chunk_corrupt_in_the_segment_file_fails_its_blocks_and_every_later_one(pool_sides):
    s = pool_sides
    tokens = random_prompt(13, 1300)
    src = list(range(0, 41))
    save_prompt(s, "r1", tokens, src)
    keys = block_keys(s.sched.ns, tokens, b"")
    shared = s.worker.store.by_name["shared"]
    wait_until(lambda: all(shared.contains(keys)), 10, "persisted")
    assert shared.delete(keys[2:3]) == 1  # the pool's copy is the only one left
    [seg] = (s.root / "shm").glob("kvtier-seg-*")
    page = s.caches["model.layers.0.self_attn.attn"][src[2 * M]]  # chunk 2's first block
    raw = page.contiguous().view(torch.uint8).numpy().tobytes()[:64]
    mem = bytearray(seg.read_bytes())
    at = mem.find(raw)
    assert at > 0
    with open(seg, "r+b") as f:  # under Mooncake's shared mapping of the same file
        f.seek(at + 10)
        f.write(bytes([mem[at + 10] ^ 1]))
    dst = list(range(60, 101))
    load_into(s, "r2", tokens, dst, tiers=["dram"] * 20)
    assert s.worker.get_block_ids_with_load_errors() == set(dst[4:40])
    assert in_place(s) == 19  # read in place and checked there; chunk 2 read again, bad
    counters = s.worker.get_stats().data["counters"]
    assert counters["load_in_place_chunks"] == 2 and counters["load_chunks"] == 2
    dram = s.worker.store.by_name["dram"]
    assert dram.counters()["corrupt"] == 1 and dram.contains(keys[2:3]) == [False]
    for a, b in zip(blocks_of(s.caches, src[:4]), blocks_of(s.caches, dst[:4])):
        assert torch.equal(a, b)


def test_the_mover_is_told_while_a_prompt_is_prefilled_in_chunks(sides):
    # vLLM prefills a long prompt over several steps; the worker's mover yields until the
    # last of them (its copies would take CPU from the prefill), then runs.
    tokens = random_prompt(3, 4 * CHUNK)
    ids = list(range(0, 4 * CHUNK // 16))
    r = request("r1", tokens)
    matched(sides.sched, r, 0)
    sides.sched.update_state_after_alloc(r, blocks(ids), 0)
    meta = step(sides.sched, [("r1", ids, 0)], {"r1": 2 * CHUNK})  # the first half
    assert meta.prefill and meta.prefill_continues
    mover = sides.worker.store.mover
    sides.worker.begin_step(meta)
    run_worker(sides.worker, meta)
    assert mover._busy  # half the prompt is still to compute
    decode = step(sides.sched, [("r2", [], 0)], {"r2": 1})
    assert not decode.prefill and not decode.prefill_continues
    sides.worker.begin_step(decode)
    run_worker(sides.worker, decode)
    assert not mover._busy
