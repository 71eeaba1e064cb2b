"""Naming per KV cache group kind: MLA's latent cache is its own geometry, the same on every
TP rank (stored once, read by all), and models kvtier cannot store are refused in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")

from engine_util import cache_config  # noqa: E402  (tests/connector is on sys.path)
from kvtier.connector import naming  # noqa: E402
from kvtier.connector.config import parse_extra_config  # noqa: E402
from kvtier.store.base.errors import ConfigError  # noqa: E402
from kvtier.tools.vllm_engine import TINY_MLA, prompt_keys  # noqa: E402


def policy(tmp_path):
    data = {"namespace": {"model": "tiny"}, "chunk_tokens": 64,
            "index": {"path": str(tmp_path / "index")},
            "tiers": [{"name": "shared", "kind": "sharedfs", "path": str(tmp_path / "s"),
                       "capacity": "1GiB"}]}
    return parse_extra_config({"policy": data}).policy, data


def mla_spec(latent=576, dtype=torch.float32):
    return vllm_kv.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=latent,
                                    dtype=dtype)


def vllm_config(tp=1, pp=1):
    return SimpleNamespace(model_config=SimpleNamespace(model="/m", architectures=["X"]),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                                           pipeline_parallel_size=pp))


def test_the_latent_cache_is_its_own_geometry(tmp_path):
    pol, _ = policy(tmp_path)
    mla = naming.kv_shape(cache_config(mla_spec()))
    assert (mla.kind, mla.heads, mla.block_size, mla.content_bytes) == ("mla", 1, 16, 576 * 4)
    ns = naming.make_namespace(vllm_config(), mla, pol)
    assert ns.layout.startswith("kvtier-mla-v1:") and ns.layout.endswith(":H1:N16:C2304")
    # a full-attention cache of exactly the same bytes per block is another namespace
    full = naming.kv_shape(cache_config(vllm_kv.FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=288, dtype=torch.float32)))
    assert full.kind == "full" and full.block_bytes == mla.block_bytes
    assert naming.make_namespace(vllm_config(), full, pol).fingerprint() != ns.fingerprint()
    other = naming.kv_shape(cache_config(mla_spec(latent=512 + 32)))
    assert naming.make_namespace(vllm_config(), other, pol).fingerprint() != ns.fingerprint()


def test_mla_is_named_once_across_tp_ranks_and_written_by_rank_0(tmp_path):
    pol, _ = policy(tmp_path)
    mla = naming.kv_shape(cache_config(mla_spec()))
    fps = {naming.make_namespace(vllm_config(tp=4), mla, pol, tp_rank=r).fingerprint()
           for r in range(4)}
    assert fps == {naming.make_namespace(vllm_config(), mla, pol).fingerprint()}
    assert [naming.saves_on_rank(mla, r) for r in range(4)] == [True, False, False, False]
    # pipeline stages hold different layers: still one namespace per stage
    assert naming.make_namespace(vllm_config(tp=2, pp=2), mla, pol, 1, 1).fingerprint() != \
        naming.make_namespace(vllm_config(tp=2, pp=2), mla, pol, 0, 0).fingerprint()
    full = naming.kv_shape(cache_config(vllm_kv.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)))
    assert len({naming.make_namespace(vllm_config(tp=2), full, pol, tp_rank=r).fingerprint()
                for r in range(2)}) == 2
    assert all(naming.saves_on_rank(full, r) for r in range(2))


def test_the_harness_names_mla_prompts_as_the_connector_does(tmp_path):
    pol, data = policy(tmp_path)
    spec = mla_spec(TINY_MLA["kv_lora_rank"] + TINY_MLA["qk_rope_head_dim"])
    ns = naming.make_namespace(vllm_config(), naming.kv_shape(cache_config(spec)), pol)
    prompt = list(range(1, 300))
    assert prompt_keys(prompt, data, "float32", 16, kind="mla") == \
        naming.token_keys(ns, prompt, b"")


def groups_config(*specs):
    tensors = [vllm_kv.KVCacheTensor(size=8 * 4096, layers=[str(i)], layer_stride=8 * 4096,
                                     block_stride=4096) for i in range(len(specs))]
    return vllm_kv.KVCacheConfig(num_blocks=8, kv_cache_tensors=tensors, kv_cache_groups=[
        vllm_kv.KVCacheGroupSpec([str(i)], s) for i, s in enumerate(specs)])


def mamba_spec(mode):
    return vllm_kv.MambaSpec(block_size=16, shapes=((3, 8), (2, 4, 4)),
                             dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode)


def test_a_recurrent_group_is_stored_as_one_state_page_per_layer(tmp_path):
    """A Mamba group kept per request (vLLM's prefix caching off) is a `state` group: one
    page of state bytes per layer (convolution and SSM state), its own namespace; the
    full-attention group keys the hit's chunks."""
    pol, _ = policy(tmp_path)
    full = vllm_kv.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                     dtype=torch.float32)
    groups = naming.kv_groups(groups_config(mamba_spec("none"), full), "GraniteX")
    state = groups[0]
    assert (state.kind, state.stateful, state.num_layers) == ("state", True, 1)
    assert state.block_bytes == 3 * 8 * 2 + 2 * 4 * 4 * 4
    assert naming.primary(groups) is groups[1]
    fps = {naming.make_namespace(vllm_config(), g, pol).fingerprint() for g in groups}
    assert len(fps) == 2


def test_a_model_with_groups_kvtier_cannot_store_is_refused_in_one_line():
    full = vllm_kv.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                     dtype=torch.float32)
    swa = vllm_kv.SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64,
                                    dtype=torch.float32, sliding_window=32)
    cases = {  # groups -> what the one line must say
        (full, mamba_spec("align")): "--no-enable-prefix-caching",
        (full, swa, mamba_spec("none")): "SlidingWindowSpec",
        (full, vllm_kv.ChunkedLocalAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32,
            attention_chunk_size=32)): "ChunkedLocalAttentionSpec"}
    for specs, why in cases.items():
        with pytest.raises(ConfigError) as e:
            naming.kv_shape(groups_config(*specs), "Qwen3NextForCausalLM")
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("kvtier cannot serve Qwen3NextForCausalLM")
        assert why in msg, msg


def test_blocks_of_one_kind_are_a_miss_for_an_engine_of_another(tmp_path):
    """An MLA engine's stored chunks, looked up by a full-attention engine of the same model
    name and the same bytes per block: a miss, never bytes to scatter; and the other way."""
    from kvtier.store.base import block
    from kvtier.store.tiered import TieredStore
    from kvtier.tiers.base import MISS
    pol, _ = policy(tmp_path)
    mla = naming.kv_shape(cache_config(mla_spec()))
    full = naming.kv_shape(cache_config(vllm_kv.FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=288, dtype=torch.float32)))
    tokens = list(range(1, 64 * 4 + 1))
    mla_keys = naming.token_keys(naming.make_namespace(vllm_config(), mla, pol), tokens, b"")
    full_keys = naming.token_keys(naming.make_namespace(vllm_config(), full, pol), tokens, b"")
    payload = bytes(4 * mla.block_bytes)  # one 64-token chunk
    with TieredStore(pol, node_id="n", mover=False) as store:
        assert all(store.save(mla_keys, [memoryview(block.encode(k, payload))
                                         for k in mla_keys]))
        assert store.lookup(mla_keys).hit_blocks == len(mla_keys)
        assert store.lookup(full_keys).hit_blocks == 0
        outs = [memoryview(bytearray(block.HEADER_SIZE + len(payload))) for _ in full_keys]
        assert store.load(full_keys, outs) == [MISS] * len(full_keys)


def test_each_group_of_a_hybrid_allocator_is_its_own_namespace(tmp_path):
    """vLLM's hybrid allocator: a sliding-window group beside a full-attention one of the
    same geometry (one layer each) gets its own kind, window and namespace; the full group
    is the one a hit's prefix is keyed by."""
    pol, _ = policy(tmp_path)
    kw = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    swa = vllm_kv.SlidingWindowSpec(sliding_window=128, **kw)
    full = vllm_kv.FullAttentionSpec(**kw)
    tensors = [vllm_kv.KVCacheTensor(size=8 * full.page_size_bytes, layers=[n],
                                     layer_stride=8 * full.page_size_bytes,
                                     block_stride=full.page_size_bytes) for n in "ab"]
    cfg = vllm_kv.KVCacheConfig(num_blocks=8, kv_cache_tensors=tensors, kv_cache_groups=[
        vllm_kv.KVCacheGroupSpec(["a"], swa), vllm_kv.KVCacheGroupSpec(["b"], full)])
    groups = naming.kv_groups(cfg)
    assert [(g.kind, g.window, g.group, g.num_layers) for g in groups] == [
        ("swa", 127, 0, 1), ("full", 0, 1, 1)]
    assert naming.kv_shape(cfg) == groups[1]
    fps = {naming.make_namespace(vllm_config(), g, pol).fingerprint() for g in groups}
    one = naming.kv_shape(cache_config(full, layers=1))  # hybrid allocator off
    fps.add(naming.make_namespace(vllm_config(), one, pol).fingerprint())
    assert len(fps) == 3
    only_windows = vllm_kv.KVCacheConfig(num_blocks=8, kv_cache_tensors=tensors,
                                         kv_cache_groups=[
        vllm_kv.KVCacheGroupSpec(["a"], swa),
        vllm_kv.KVCacheGroupSpec(["b"], vllm_kv.SlidingWindowSpec(sliding_window=64, **kw))])
    with pytest.raises(ConfigError, match="all its KV cache groups are sliding-window"):
        naming.kv_groups(only_windows, "X")
