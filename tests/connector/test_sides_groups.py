"""Both connector sides over two KV cache groups, as vLLM's hybrid allocator runs a Gemma 3
or gpt-oss shape: a sliding-window layer and a full-attention layer, each group with its own
block ids over one shared KV memory. Driven step by step without an engine (real store,
real paged cache in vLLM's CPU layout), as `test_sides` does for one group.

What must hold: the full group stores every chunk and the sliding-window group only the
chunks a window can reach from the end of the prompt on (and from where a lookup found
another prompt's chunks but no window: a fork); a hit is promised only where the window
before its end is stored, and loads only that window into that group; a load that falls
short in any group recomputes the request (`failed_recving`), never block ids.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")

from kvtier.connector.config import ConnectorConfig  # noqa: E402
from kvtier.connector.naming import rank_keys  # noqa: E402
from kvtier.connector.scheduler import NULL_BLOCK, SchedulerSide  # noqa: E402
from kvtier.connector.worker import WorkerSide  # noqa: E402
from kvtier.store.base.config import policy_from_dict  # noqa: E402
from kvtier.tools.vllm_engine import random_prompt  # noqa: E402

from conftest import matched  # noqa: E402
from engine_util import files_of  # noqa: E402

BS, CHUNK, NB, H, D = 32, 64, 256, 2, 64
M = CHUNK // BS
WINDOW = 128  # vLLM's sliding_window: the next token reads the 127 before it
SWA, FULL = 0, 1  # vLLM's group order for the tiny Gemma 3 shape


@pytest.fixture
def sides(tmp_path):
    policy = policy_from_dict({
        "namespace": {"model": "unit"}, "chunk_tokens": CHUNK,
        "index": {"path": str(tmp_path / "index"), "map_size": "32MiB"},
        "tiers": [{"name": "shared", "kind": "sharedfs", "path": str(tmp_path / "shared"),
                   "capacity": "64MiB"}]})
    kw = dict(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    specs = [vllm_kv.SlidingWindowSpec(sliding_window=WINDOW, **kw),
             vllm_kv.FullAttentionSpec(**kw)]
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    layout = vllm_kv.KVCacheLayout.LBHNC
    tensors = []
    for name, spec in zip(names, specs):
        layer_stride, block_stride, *_ = vllm_kv.compute_layout_strides(spec, NB, 1, layout)
        tensors.append(vllm_kv.KVCacheTensor(size=NB * spec.page_size_bytes, layers=[name],
                                             layer_stride=layer_stride,
                                             block_stride=block_stride))
    kvc = vllm_kv.KVCacheConfig(num_blocks=NB, kv_cache_tensors=tensors, kv_cache_groups=[
        vllm_kv.KVCacheGroupSpec([n], s) for n, s in zip(names, specs)])
    # one memory under both layers, as the hybrid allocator shares it: block ids of the two
    # groups never overlap
    raw = torch.zeros(tensors[0].size, dtype=torch.int8)
    caches = {n: vllm_kv.create_kv_cache_views(raw, s, NB, layout, t)[0]
              for n, s, t in zip(names, specs, tensors)}
    caches[names[0]].copy_(torch.randn(caches[names[0]].shape).to(torch.bfloat16))
    vconf = SimpleNamespace(model_config=SimpleNamespace(model="/m"),
                            parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                            pipeline_parallel_size=1),
                            scheduler_config=SimpleNamespace(max_num_batched_tokens=8192))
    cfg = ConnectorConfig(policy, "unit", 1 << 20, 2, "async", load_deadline=False)
    worker = WorkerSide(vconf, kvc, cfg)
    sched = SchedulerSide(vconf, kvc, cfg)
    worker.register_kv_caches(caches)
    s = SimpleNamespace(sched=sched, worker=worker, cache=caches[names[0]], root=tmp_path)
    yield s
    worker.shutdown()
    sched.shutdown()


def request(req_id, tokens):
    return SimpleNamespace(request_id=req_id, all_token_ids=list(tokens),
                           num_tokens=len(tokens), num_prompt_tokens=len(tokens),
                           num_computed_tokens=0, prompt_embeds=None, lora_request=None,
                           cache_salt=None, mm_features=[], kv_transfer_params=None)


def step(sched, new=(), scheduled=None):
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=ids, num_computed_tokens=c)
                            for r, ids, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens=scheduled or {})
    return sched.build_connector_meta(out)


def settle(s, meta, req_id):
    """Run the step's jobs on the worker until `req_id`'s load ends; vLLM's transfer
    results, after the worker's report has reached the scheduler."""
    s.worker.start_load_kv(meta)
    s.worker.wait_for_save(meta)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        res = s.worker.get_transfer_results(set())
        if req_id in res.finished_recving:
            s.sched.update_connector_output(
                SimpleNamespace(kv_connector_worker_meta=s.worker.build_worker_meta()))
            return res
        time.sleep(0.005)
    raise AssertionError(f"the load of {req_id} never ended")


def idle(s):
    deadline = time.monotonic() + 10
    while not all(g.io.idle() for g in s.worker.groups.values()):
        assert time.monotonic() < deadline
        time.sleep(0.005)


def save(s, req_id, tokens, full_ids, swa_ids):
    r = request(req_id, tokens)
    assert matched(s.sched, r, 0) == (0, False)
    meta = step(s.sched, [(req_id, (swa_ids, full_ids), 0)], {req_id: len(tokens)})
    s.worker.wait_for_save(meta)
    idle(s)
    r.num_computed_tokens = len(tokens)
    assert s.sched.request_finished(r, (swa_ids, full_ids))[0] is False
    return meta


def window_ids(n_blocks, end_tokens, first_id):
    """A sliding-window group's block ids after a hit of `end_tokens`: vLLM's null block
    where no attention reads any more, new blocks for the rest."""
    skipped = (end_tokens - WINDOW + 1) // BS
    return [NULL_BLOCK] * skipped + list(range(first_id, first_id + n_blocks - skipped))


def blocks(cache, ids):
    return cache[list(ids)].clone()


def test_the_window_group_stores_only_what_a_window_reaches_and_loads_only_that(sides):
    tokens = random_prompt(1, 10 * CHUNK + 1)  # 10 whole chunks, one token to compute
    nb = 10 * M + 1
    full_a, swa_a = list(range(1, 1 + nb)), list(range(30, 30 + nb))
    meta = save(sides, "a", tokens, full_a, swa_a)
    saved = {j.group: len(j.keys) for j in meta.saves}
    # the window of a hit at the prompt's end (640 tokens) reaches back to token 513
    # (chunk 8); chunks from 7 on are kept, for a hit ending one chunk earlier
    assert saved == {FULL: 10, SWA: 3}
    assert sides.worker.get_stats().data["counters"]["save_chunks"] == 13

    r = request("b", tokens)
    n, is_async = matched(sides.sched, r, 0)
    assert (n, is_async) == (10 * CHUNK, True)  # several groups: async loads only
    full_b, swa_b = list(range(100, 100 + nb)), window_ids(nb, 10 * CHUNK, 150)
    sides.sched.update_state_after_alloc(
        r, SimpleNamespace(get_block_ids=lambda: (swa_b, full_b)), n)
    meta = step(sides.sched)
    jobs = {j.group: j for j in meta.loads}
    assert len(jobs[FULL].keys) == 10 and jobs[FULL].skip_first == 0
    # the window group loads blocks 16..19 (chunks 8 and 9): vLLM gave blocks 0..15 its
    # null block, as no attention reads them from token 640 on
    assert len(jobs[SWA].keys) == 2 and jobs[SWA].skip_first == 0
    assert jobs[SWA].block_ids == [swa_b[16:18], swa_b[18:20]]
    assert NULL_BLOCK not in swa_b[16:20] and set(swa_b[:16]) == {NULL_BLOCK}
    res = settle(sides, meta, "b")
    assert res.failed_recving == set()
    assert torch.equal(blocks(sides.cache, full_a[:20]), blocks(sides.cache, full_b[:20]))
    assert torch.equal(blocks(sides.cache, swa_a[16:20]), blocks(sides.cache, swa_b[16:20]))
    assert sides.sched.get_stats().data["counters"]["hit_tokens:shared"] == 10 * CHUNK
    r.num_computed_tokens = len(tokens)
    _, params = sides.sched.request_finished(r, (swa_b, full_b))
    assert params["kvtier"]["hit_tokens"] == {"shared": 10 * CHUNK}


def test_no_hit_ends_where_the_window_before_it_was_not_stored(sides):
    tokens = random_prompt(2, 10 * CHUNK + 1)
    nb = 10 * M + 1
    save(sides, "a", tokens, list(range(1, 1 + nb)), list(range(30, 30 + nb)))
    # every full-attention chunk of a shorter prompt is stored, but not the window before
    # its end: recomputing beats a hit whose sliding-window layers would read nothing
    short = request("b", tokens[:5 * CHUNK + 1])
    assert matched(sides.sched, short, 0) == (0, False)
    # one chunk short of the prompt's end: its window (chunks 7 and 8) is stored
    nine = request("c", tokens[:9 * CHUNK + 1])
    assert matched(sides.sched, nine, 0) == (9 * CHUNK, True)


def test_a_window_chunk_lost_before_its_load_recomputes_the_request(sides):
    tokens = random_prompt(3, 10 * CHUNK + 1)
    nb = 10 * M + 1
    save(sides, "a", tokens, list(range(1, 1 + nb)), list(range(30, 30 + nb)))
    r = request("b", tokens)
    n, _ = matched(sides.sched, r, 0)
    full_b, swa_b = list(range(100, 100 + nb)), window_ids(nb, 10 * CHUNK, 150)
    sides.sched.update_state_after_alloc(
        r, SimpleNamespace(get_block_ids=lambda: (swa_b, full_b)), n)
    meta = step(sides.sched)
    swa_job = next(j for j in meta.loads if j.group == SWA)
    fp = sides.worker.groups[SWA].fingerprint
    for path in files_of(sides.root / "shared", rank_keys(swa_job.keys[-1:], fp)):
        path.unlink()
    res = settle(sides, meta, "b")
    # vLLM takes several groups' load failures per request, never as block ids
    assert res.failed_recving == {"b"} and "b" in res.finished_recving
    assert sides.worker.get_block_ids_with_load_errors() == set()
    r.num_computed_tokens = len(tokens)
    _, params = sides.sched.request_finished(r, (swa_b, full_b))
    assert params["kvtier"]["hit_tokens"] == {}
    assert params["kvtier"]["recomputed_tokens"] == 10 * CHUNK


def test_a_fork_from_the_middle_of_a_stored_prompt_stores_its_window_for_the_next(sides):
    """A prompt that shares only the first 5 chunks of a stored one (a shared system prompt,
    a sub-agent's task) finds no window there and recomputes; it saves the window before
    that end as it computes it, so the next prompt forking there hits."""
    tokens = random_prompt(4, 10 * CHUNK + 1)
    nb = 10 * M + 1
    full_a = list(range(1, 1 + nb))
    save(sides, "a", tokens, full_a, list(range(30, 30 + nb)))
    shared = tokens[:5 * CHUNK]
    full_b, swa_b = list(range(60, 60 + nb)), list(range(90, 90 + nb))
    meta = save(sides, "b", shared + random_prompt(5, 5 * CHUNK + 1), full_b, swa_b)
    swa_saved = next(j for j in meta.saves if j.group == SWA)
    # its own prompt end's window (chunks 7..9) and the window before the fork (chunks 3, 4)
    assert swa_saved.block_ids == [swa_b[c * M:(c + 1) * M] for c in (3, 4, 7, 8, 9)]

    r = request("c", shared + random_prompt(6, 5 * CHUNK + 1))
    n, is_async = matched(sides.sched, r, 0)
    assert (n, is_async) == (5 * CHUNK, True)
    full_c, swa_c = list(range(120, 120 + nb)), window_ids(nb, 5 * CHUNK, 160)
    sides.sched.update_state_after_alloc(
        r, SimpleNamespace(get_block_ids=lambda: (swa_c, full_c)), n)
    meta = step(sides.sched)
    jobs = {j.group: j for j in meta.loads}
    assert len(jobs[FULL].keys) == 5
    assert jobs[SWA].block_ids == [swa_c[6:8], swa_c[8:10]]
    res = settle(sides, meta, "c")
    assert res.failed_recving == set()
    # the window came from b, which computed it; the full chunks are a's (stored first)
    assert torch.equal(blocks(sides.cache, swa_b[6:10]), blocks(sides.cache, swa_c[6:10]))
    assert torch.equal(blocks(sides.cache, full_a[:10]), blocks(sides.cache, full_c[:10]))
