"""The tiny random models tests, benchmarks and replays serve, one per architecture kind.

Each is built with `transformers` configs and `save_pretrained` (nothing is downloaded),
seeded, so every process that builds one gets the same weights:

- `llama`: a 2-layer Llama (GQA, full attention: one KV cache group).
- `mla`: a 2-layer DeepSeek-V2 shape with multi-head latent attention. The latent is
  `kv_lora_rank` 512 + rope 64: vLLM's CPU MLA kernel compiles only for 576. Dense MLPs only
  (vLLM's CPU MoE router rejects tiny expert counts). vLLM's CPU build runs it on `CPU_MLA`
  with block size 16 and turns its own prefix caching off.
- `swa`: a 2-layer Gemma 3 text shape, one sliding-window layer beside one full-attention
  layer (two KV cache groups when vLLM's hybrid allocator is on).
- `hybrid`: a 2-layer Granite 4.0-H shape (`GraniteMoeHybrid`, no experts), one Mamba2
  layer beside one full-attention layer: a recurrent-state group and an attention group.
  vLLM's CPU build runs it with prefix caching off only (its prefix caching keeps per-block
  states through a kernel path the CPU build lacks), so kvtier is its prefix cache.
- `nemotronh`: a 2-layer NemotronH shape, one Mamba2 layer beside one attention layer.
- `qwen3next`: a 4-layer Qwen3-Next shape, three gated delta-net (linear attention) layers
  beside one full-attention layer, dense MLPs but the last (vLLM's Qwen3-Next needs one
  MoE layer). The CPU build's delta-net kernel takes bfloat16 and 128-wide heads only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TINY_MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
                  initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_MLA = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=65536,
                initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32,
                v_head_dim=32, first_k_dense_replace=2, n_routed_experts=4,
                n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64)
TINY_SWA = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                max_position_embeddings=65536, initializer_range=0.05, rms_norm_eps=1e-5,
                sliding_window=128, layer_types=["sliding_attention", "full_attention"],
                tie_word_embeddings=False)
TINY_HYBRID = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=65536, initializer_range=0.05, rms_norm_eps=1e-5,
                   tie_word_embeddings=False, layer_types=["mamba", "attention"],
                   mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                   mamba_expand=1, mamba_chunk_size=64, mamba_d_conv=4, num_local_experts=0,
                   shared_intermediate_size=512)
TINY_NEMOTRONH = dict(vocab_size=2048, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=65536, initializer_range=0.05,
                      tie_word_embeddings=False, hybrid_override_pattern="M*",
                      mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=1,
                      chunk_size=64, conv_kernel=4)
TINY_QWEN3NEXT = dict(vocab_size=2048, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=65536, initializer_range=0.05,
                      tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64, shared_expert_intermediate_size=64,
                      decoder_sparse_step=1, mlp_only_layers=[0, 1, 2],
                      linear_num_value_heads=4, linear_num_key_heads=2,
                      linear_key_head_dim=128, linear_value_head_dim=128,
                      layer_types=["linear_attention"] * 3 + ["full_attention"])
# vLLM's block size each kind runs with on the CPU build (CPU_MLA takes 16 only; a hybrid's
# attention page must hold a recurrent layer's state: 64 tokens do for the Mamba2 shapes,
# the delta-net state of the Qwen3-Next shape takes 576, the size vLLM picks for it)
BLOCK_SIZE = {"llama": 32, "mla": 16, "swa": 32, "hybrid": 64, "nemotronh": 64,
              "qwen3next": 576}
# the hybrid kinds (a recurrent state beside attention)
RECURRENT_KINDS = ("hybrid", "nemotronh", "qwen3next")
MODEL_KINDS = tuple(BLOCK_SIZE)
# `LLM(...)` arguments each kind needs on the CPU build. The CPU `rotary_embedding` kernel
# rotated the rope part of some of MLA's latent rows twice (measured: the first tokens an
# engine computed after a hit, their k_pe turned by a second position), so the MLA model
# takes vLLM's native rope; with it a hit gives the cold engine's tokens exactly. On a host
# with AMX tiles vLLM prefers its AMX MLA backend, which takes 16-bit weights only; the
# reference CPU backend runs the float32 model on every host.
ENGINE_ARGS: dict[str, dict[str, Any]] = {
    "llama": {}, "swa": {}, "hybrid": {"enable_prefix_caching": False},
    "nemotronh": {"enable_prefix_caching": False},
    "qwen3next": {"enable_prefix_caching": False, "dtype": "bfloat16"},
    "mla": {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]},
            "attention_config": {"backend": "CPU_MLA"}}}


def _build(kind: str, overrides: dict[str, Any]):
    import transformers as tf
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY_MODEL, **overrides}))
    if kind == "mla":
        return tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**{**TINY_MLA, **overrides}))
    if kind == "swa":
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**TINY_SWA, **overrides}))
    if kind == "hybrid":
        return tf.GraniteMoeHybridForCausalLM(
            tf.GraniteMoeHybridConfig(**{**TINY_HYBRID, **overrides}))
    if kind == "nemotronh":
        return tf.NemotronHForCausalLM(tf.NemotronHConfig(**{**TINY_NEMOTRONH, **overrides}))
    if kind == "qwen3next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**{**TINY_QWEN3NEXT, **overrides}))
    raise ValueError(f"unknown model kind {kind!r}; use one of {', '.join(MODEL_KINDS)}")


def make_tiny_model(path: str | os.PathLike[str], kind: str = "llama", **overrides: Any) -> Path:
    """Build (once) the tiny random model of `kind` under `path`; returns the path."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch
    torch.manual_seed(1234)
    model = _build(kind, overrides).to(torch.bfloat16)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path
