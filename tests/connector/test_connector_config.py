"""Connector config and naming: one-line errors that name the field, keys that separate what
must be separated (model, rank, LoRA, cache salt, multimodal inputs) and nothing else."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine_util import cache_config  # (tests/connector is on sys.path)
from kvtier.connector.config import parse_extra_config
from kvtier.store.base.errors import ConfigError
from kvtier.store.base.keys import NS_HEX, is_key

naming = pytest.importorskip("kvtier.connector.naming")
vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")


def policy_dict(root, **over):
    data = {"chunk_tokens": 64, "index": {"path": str(root / "index")},
            "master": {"address": "127.0.0.1:1", "embedded": False},
            "tiers": [{"name": "shared", "kind": "sharedfs", "path": str(root / "shared"),
                       "capacity": "64MiB"}]}
    data.update(over)
    return data


def test_inline_policy_and_defaults(tmp_path):
    cfg = parse_extra_config({"policy": policy_dict(tmp_path)})
    assert cfg.policy.chunk_tokens == 64
    assert cfg.staging_buffer_bytes == 64 << 20 and cfg.staging_buffers == 4
    assert cfg.node_id is None and cfg.load == "async"


def test_policy_file_and_sizes(tmp_path):
    import yaml
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy_dict(tmp_path)))
    cfg = parse_extra_config({"kvtier_config": str(path), "staging_buffer": "8MiB",
                              "staging_buffers": 2, "node_id": "node-a", "load": "auto",
                              "tool_call_token_ids": [151657, 128008]})
    assert cfg.policy.source == str(path)
    assert (cfg.staging_buffer_bytes, cfg.staging_buffers, cfg.node_id, cfg.load) == (
        8 << 20, 2, "node-a", "auto")
    assert cfg.tool_call_token_ids == (151657, 128008)
    assert parse_extra_config({}).tool_call_token_ids == "auto"
    assert parse_extra_config({"tool_call_token_ids": []}).tool_call_token_ids == ()


def test_no_config_uses_the_default_policy():
    assert parse_extra_config(None).policy.chunk_tokens == 256
    assert parse_extra_config({}).policy.source == "<default policy>"


@pytest.mark.parametrize("extra, match", [
    ({"kvtier_confg": "x.yaml"}, r"^kv_connector_extra_config: kvtier_confg: unknown field; "
                                 r"expected one of: kvtier_config, policy"),
    ({"staging_buffer": "lots"}, r"^kv_connector_extra_config: staging_buffer: .*size"),
    ({"staging_buffers": 0}, r"^kv_connector_extra_config: staging_buffers: "),
    ({"node_id": "a b"}, r"^kv_connector_extra_config: node_id: "),
    ({"load": "eager"}, r"^kv_connector_extra_config: load: .*'auto', 'async' or 'sync'"),
    ({"tool_call_token_ids": [-1]},
     r"^kv_connector_extra_config: tool_call_token_ids: expected 'auto' or a list of token"),
    ({"tool_call_token_ids": "<tool_call>"}, r"^kv_connector_extra_config: tool_call_token_ids"),
    ({"policy": [1, 2]}, r"^kv_connector_extra_config: policy: "),
    ({"kvtier_config": "/nonexistent/p.yaml"}, r"/nonexistent/p.yaml: no such policy file"),
    ("policy.yaml", r"^kv_connector_extra_config: expected a mapping, got str"),
])
def test_bad_extra_config_is_one_line_naming_the_field(extra, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_extra_config(extra)
    assert "\n" not in str(err.value)


def test_both_sources_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="kvtier_config and policy are both set"):
        parse_extra_config({"kvtier_config": "p.yaml", "policy": policy_dict(tmp_path)})


def test_bad_inline_policy_names_the_policy_field(tmp_path):
    bad = policy_dict(tmp_path, tiers=[{"name": "shared", "kind": "sharedfs",
                                        "path": str(tmp_path), "capacity": "huge"}])
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.policy: "
                                          r"tiers\[0\]\.capacity"):
        parse_extra_config({"policy": bad})


# ---- naming ------------------------------------------------------------------------------

def kv_cache_config(layers=2, block_size=32, heads=2, head=64, dtype=torch.bfloat16):
    spec = vllm_kv.FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head,
                                     dtype=dtype)
    return cache_config(spec, layers)


def vllm_config(model="/models/tiny", tp=1, pp=1):
    return SimpleNamespace(model_config=SimpleNamespace(model=model),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                                           pipeline_parallel_size=pp))


def test_namespace_fingerprints_geometry_and_rank(tmp_path):
    policy = parse_extra_config({"policy": policy_dict(tmp_path)}).policy
    shape = naming.kv_shape(kv_cache_config())
    assert (shape.num_layers, shape.heads, shape.block_size, shape.content_bytes) == \
        (2, 2, 32, 256)
    assert shape.dtype == "bfloat16"
    ns = naming.make_namespace(vllm_config(), shape, policy)
    assert ns.layout == "kvtier-v1:BL-HNC:L2:H2:N32:C256" and ns.chunk_tokens == 64
    fps = {ns.fingerprint(),
           naming.make_namespace(vllm_config(model="/models/other"), shape, policy).fingerprint(),
           naming.make_namespace(vllm_config(tp=2), shape, policy, tp_rank=1).fingerprint(),
           naming.make_namespace(vllm_config(), naming.kv_shape(kv_cache_config(heads=4)),
                                 policy).fingerprint(),
           naming.make_namespace(vllm_config(), naming.kv_shape(
               kv_cache_config(dtype=torch.float16)), policy).fingerprint()}
    assert len(fps) == 5
    named = parse_extra_config({"policy": policy_dict(
        tmp_path, namespace={"model": "tiny-llama"})}).policy
    assert naming.make_namespace(vllm_config(model="/a"), shape, named) == \
        naming.make_namespace(vllm_config(model="/b"), shape, named)


def test_chunk_tokens_must_be_a_multiple_of_the_block_size(tmp_path):
    policy = parse_extra_config({"policy": policy_dict(tmp_path, chunk_tokens=48)}).policy
    with pytest.raises(ConfigError, match=r"chunk_tokens: 48 is not a multiple of vLLM's "
                                          r"block size 32; .*\(e\.g\. 96\)"):
        naming.make_namespace(vllm_config(), naming.kv_shape(kv_cache_config()), policy)


def test_rank_keys_swap_only_the_namespace(tmp_path):
    policy = parse_extra_config({"policy": policy_dict(tmp_path)}).policy
    shape = naming.kv_shape(kv_cache_config())
    ns0 = naming.make_namespace(vllm_config(tp=2), shape, policy)
    ns1 = naming.rank_namespace(ns0, 1, 0)
    keys = naming.block_keys(ns0, list(range(200)), b"")
    swapped = naming.rank_keys(keys, ns1.fingerprint())
    assert swapped == naming.block_keys(ns1, list(range(200)), b"")
    assert all(is_key(k) and k[NS_HEX:] == o[NS_HEX:] for k, o in zip(swapped, keys))


def request(**kw):
    base = dict(request_id="r1", prompt_embeds=None, lora_request=None, cache_salt=None,
                mm_features=[], kv_transfer_params=None)
    return SimpleNamespace(**{**base, **kw})


def test_salt_separates_lora_cache_salt_and_images():
    plain = naming.request_salt(request())
    lora = naming.request_salt(request(lora_request=SimpleNamespace(lora_name="sql")))
    salted = naming.request_salt(request(cache_salt="tenant-7"))
    image = SimpleNamespace(identifier="img-abc", mm_position=SimpleNamespace(offset=5))
    mm = naming.request_salt(request(mm_features=[image]))
    assert plain == b"" and len({plain, lora, salted, mm}) == 4
    assert naming.request_salt(request(prompt_embeds=torch.zeros(3, 4))) is None


def test_session_hint_from_kv_transfer_params(caplog):
    hint = naming.session_hint(request(kv_transfer_params={
        "kvtier": {"session_id": "s-1", "expected_gap_s": 4}}))
    assert (hint.session_id, hint.expected_gap_s) == ("s-1", 4.0)
    assert naming.session_hint(request()) is None
    assert naming.session_hint(request(kv_transfer_params={"other": 1})) is None
    for bad in ({"session_id": 5}, {"expected_gap_s": -1}, "s-1", {"expected_gap_s": "soon"}):
        assert naming.session_hint(request(kv_transfer_params={"kvtier": bad})) is None
    assert "ignoring malformed kv_transfer_params.kvtier" in caplog.text
