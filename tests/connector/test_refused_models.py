"""A model kvtier cannot serve stops vLLM at start with one line naming its architecture and
why: attention-free models, and state-space / linear-attention hybrids with vLLM's prefix
caching on (vLLM then keeps per-block states kvtier does not restore; with it off kvtier
stores the state itself)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from test_serve import stopped_at_start  # noqa: E402  (tests/connector is on sys.path)

from kvtier.connector.early_check import refusal  # noqa: E402

pytestmark = pytest.mark.vllm


def test_refusal_names_the_architecture_and_why():
    hybrid = SimpleNamespace(is_hybrid=True, is_attention_free=False,
                             architectures=["JambaForCausalLM"])
    for on in (None, SimpleNamespace(enable_prefix_caching=True),
               SimpleNamespace(enable_prefix_caching=None)):
        msg = refusal(hybrid, on)
        assert msg.startswith("kvtier cannot serve JambaForCausalLM with vLLM's prefix caching "
                              "on: it keeps recurrent state")
        assert "\n" not in msg and "--no-enable-prefix-caching" in msg
    assert refusal(hybrid, SimpleNamespace(enable_prefix_caching=False)) is None
    free = SimpleNamespace(is_hybrid=False, is_attention_free=True, architectures=["MambaX"])
    assert "has no attention KV" in refusal(free)
    assert "has no attention KV" in refusal(free, SimpleNamespace(enable_prefix_caching=False))
    for ok in (SimpleNamespace(is_hybrid=False, is_attention_free=False, architectures=["L"]),
               None, SimpleNamespace()):
        assert refusal(ok) is None


def tiny_qwen3_next(path):
    """The config of a tiny Qwen3-Next (gated delta-net layers beside full attention): vLLM
    decides before it loads any weight, so the config is all the model needs."""
    from transformers import Qwen3NextConfig
    Qwen3NextConfig(vocab_size=2048, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=64, shared_expert_intermediate_size=64,
                    max_position_embeddings=4096,
                    architectures=["Qwen3NextForCausalLM"]).save_pretrained(path)
    return path


TRANSFER = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {}}
WHY = "kvtier cannot serve Qwen3NextForCausalLM with vLLM's prefix caching on"


def test_a_state_space_hybrid_is_refused_while_vllm_builds_its_config(tmp_path):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from kvtier.store.base.errors import ConfigError
    model = tiny_qwen3_next(tmp_path / "tiny-qwen3-next")
    args = EngineArgs(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
                      max_model_len=4096, kv_transfer_config=KVTransferConfig(**TRANSFER))
    with pytest.raises(ConfigError) as e:
        args.create_engine_config()
    assert str(e.value).startswith(WHY) and "\n" not in str(e.value)


@pytest.mark.slow
def test_a_state_space_hybrid_stops_the_server_in_one_line(tmp_path):
    model = tiny_qwen3_next(tmp_path / "tiny-qwen3-next")
    log = stopped_at_start(model, TRANSFER, tmp_path / "server.log")
    assert log.rstrip().splitlines()[-1].startswith(WHY), log[-3000:]
    assert log.count("cannot serve") == 1
