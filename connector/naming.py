"""What a request's blocks are called: the namespace, the salt, the keys and the session hint.

The namespace is computed from the vLLM config and the KV cache spec alone, identically on
the scheduler (which has no tensors) and on every worker; the worker then checks that the
tensors it was given match it (`check_layout`). Keys are the chained chunk hashes of
`kvtier.store.base.keys` (blake2b over token ids: no `PYTHONHASHSEED` dependence), salted by what
changes the KV of equal tokens: LoRA adapter, `cache_salt`, multimodal inputs. Requests
given as prompt embeddings have no token ids to key and bypass kvtier.

Metadata carries keys in the namespace of TP/PP rank 0; each worker swaps in its own
namespace fingerprint (`rank_keys`), so one scheduler lookup names every rank's blocks.

Each kind of KV cache group has its own payload format (`PAYLOAD_FORMATS`), named in the
namespace: a block stored by one kind can never be read as another (its key differs, so it
is a miss). MLA's latent cache (`mla`) is one latent vector per token, the same on every
TP rank: its namespace leaves the TP rank and size out, so the blocks are stored once (by
TP rank 0) and every rank reads them.

A recurrent model (state-space or linear-attention layers beside attention: Granite 4.0-H,
Jamba, NemotronH, Qwen3-Next) keeps one state per request, valid at one position. What is
stored for such a position is keyed by an *end key* (`end_keys`: the chain of the chunks
before it and the tokens after them): each recurrent group's state, and each attention
group's part-chunk of KV before the position.

With vLLM's hybrid memory allocator an engine keeps several KV cache groups (full attention
beside sliding-window attention: Gemma 3, gpt-oss), each with its own block ids. Each group
is stored under its own namespace (its kind, geometry, window and place among the groups):
a chunk has one key per group, all over the same chained token hash, so the keys of every
group follow from the first group's by swapping the namespace fingerprint (`rank_keys`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from kvtier.connector.layout import PAYLOAD_FORMATS, LayoutError, LayoutInfo
from kvtier.store.base.config import Policy
from kvtier.store.base.errors import ConfigError
from kvtier.store.base.keys import NS_HEX, Namespace, block_keys
from kvtier.store.tiered import SessionHint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVShape:
    """The per-block KV geometry of one of the model's attention KV cache groups."""

    num_layers: int
    heads: int
    block_size: int
    content_bytes: int  # bytes per (head, token): K then V (MLA: the latent and rope part)
    dtype: str
    kind: str = "full"  # a key of PAYLOAD_FORMATS
    window: int = 0     # `swa`: tokens below the next one that its attention still reads
    group: int = 0      # its index among the engine's KV cache groups
    groups: int = 1     # how many groups the engine keeps
    layer_names: tuple[str, ...] = ()

    @property
    def windowed(self) -> bool:
        """Whether only the last `window` tokens before a hit's end need this group's KV."""
        return self.kind == "swa"

    @property
    def stateful(self) -> bool:
        """Whether the group holds a recurrent state per request, not KV per token (a
        state-space or linear-attention layer): one page per layer, valid at one position."""
        return self.kind == "state"

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.heads * self.block_size * self.content_bytes

    @property
    def tp_replicated(self) -> bool:
        """Whether every TP rank holds the same bytes (MLA): stored once, read by all."""
        return self.kind == "mla"


def saves_on_rank(shape: KVShape, tp_rank: int) -> bool:
    """Whether the worker at `tp_rank` writes its blocks (of replicated KV, rank 0 only)."""
    return tp_rank == 0 or not shape.tp_replicated


def architecture(vllm_config: Any) -> str:
    """The model's architecture name (for messages), or "this model"."""
    archs = getattr(getattr(vllm_config, "model_config", None), "architectures", None)
    return archs[0] if archs else "this model"


def kv_groups(kv_cache_config: Any, architecture: str = "this model") -> list[KVShape]:
    """The geometry of each of vLLM's KV cache groups (`KVCacheConfig`), in vLLM's order.

    One group (the hybrid allocator off, or a model with one kind of attention layer) is
    stored as `full` or `mla`, every layer for every token, as before groups existed.
    Several groups must each be full, MLA or sliding-window attention, or the recurrent
    state of state-space / linear-attention layers (`state`, vLLM's `MambaSpec`) beside
    full attention, kept by vLLM per request (`mamba_cache_mode` "none": prefix caching
    off); any other kind (cross-attention, chunked local attention) or combination raises
    ConfigError naming the architecture and the kinds."""
    from vllm.v1.kv_cache_interface import (AttentionSpec, FullAttentionSpec,
                                            MambaSpec, MLAAttentionSpec, SlidingWindowSpec)

    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    several = len(groups) > 1
    if several:
        ok = all(type(s) in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec,
                             MambaSpec) for s in specs)
    else:
        ok = len(specs) == 1 and isinstance(specs[0], AttentionSpec)
    if not ok:
        kinds = ", ".join(type(s).__name__ for s in specs)
        fix = ("serve it with --disable-hybrid-kv-cache-manager (one KV cache group) or "
               "without the kvtier connector") if several and all(
            isinstance(s, AttentionSpec) for s in specs) else \
            "serve it without the kvtier connector"
        raise ConfigError(f"kvtier cannot serve {architecture}: its KV cache groups are "
                          f"[{kinds}], kvtier stores full-attention, MLA, sliding-window "
                          f"and recurrent-state groups; {fix}")
    if several and all(isinstance(s, SlidingWindowSpec) for s in specs):
        raise ConfigError(f"kvtier cannot serve {architecture}: all its KV cache groups are "
                          "sliding-window, kvtier needs a full-attention group beside them; "
                          "serve it with --disable-hybrid-kv-cache-manager")
    states = [s for s in specs if isinstance(s, MambaSpec)]
    if states:
        _check_states(architecture, specs, states)
    return [_group_shape(kv_cache_config, i, len(groups)) for i in range(len(groups))]


def _check_states(architecture: str, specs: list[Any], states: list[Any]) -> None:
    """Raise ConfigError unless kvtier can restore these recurrent groups: states kept per
    request (not vLLM's own per-block copies) beside full attention only."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    modes = {s.mamba_cache_mode for s in states}
    if modes != {"none"}:
        raise ConfigError(f"kvtier cannot serve {architecture} with vLLM's prefix caching on "
                          f"(mamba_cache_mode {'/'.join(sorted(modes))}): kvtier keeps the "
                          "recurrent state itself; serve it with --no-enable-prefix-caching "
                          "(kvtier is then its prefix cache)")
    others = {type(s).__name__ for s in specs if not isinstance(s, MambaSpec)}
    if others != {FullAttentionSpec.__name__}:
        raise ConfigError(f"kvtier cannot serve {architecture}: its KV cache groups mix "
                          f"recurrent state with [{', '.join(sorted(others))}], kvtier "
                          "restores state beside full attention only; serve it without the "
                          "kvtier connector")


def _group_shape(kv_cache_config: Any, i: int, n: int) -> KVShape:
    from vllm.v1.kv_cache_interface import (MambaSpec, MLAAttentionSpec, SlidingWindowSpec,
                                            compute_layer_kv_cache_shape_bytes)

    group = kv_cache_config.kv_cache_groups[i]
    spec = group.kv_cache_spec
    names = set(group.layer_names)
    layers = sum(len(names.intersection(t.layers)) for t in kv_cache_config.kv_cache_tensors)
    _, heads, tokens, content = compute_layer_kv_cache_shape_bytes(spec, 1)
    if isinstance(spec, MambaSpec):  # one page of state bytes per layer and request
        dtype = "/".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        shapes = ";".join("x".join(map(str, s)) for s in spec.shapes)
        return KVShape(layers, heads, tokens, content, f"{dtype}:{shapes}", "state", 0, i, n,
                       tuple(group.layer_names))
    dtype = str(spec.dtype).removeprefix("torch.")
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and getattr(quant, "name", "NONE") != "NONE":
        dtype += f"/{quant.name.lower()}"
    kind, window = ("mla" if isinstance(spec, MLAAttentionSpec) else "full"), 0
    if n > 1 and isinstance(spec, SlidingWindowSpec):
        # vLLM keeps the blocks of the last `sliding_window - 1` tokens, and some more
        kind = "swa"
        window = spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)
    return KVShape(layers, heads, tokens, content, dtype, kind, window, i, n,
                   tuple(group.layer_names))


def kv_shape(kv_cache_config: Any, architecture: str = "this model") -> KVShape:
    """The geometry of the first group that holds every token (`kv_groups`): the one whose
    chunks make a hit's prefix."""
    return primary(kv_groups(kv_cache_config, architecture))


def primary(shapes: list[KVShape]) -> KVShape:
    return next(s for s in shapes if not (s.windowed or s.stateful))


def make_namespace(vllm_config: Any, shape: KVShape, policy: Policy,
                   tp_rank: int = 0, pp_rank: int = 0) -> Namespace:
    """The namespace of this engine's blocks at one TP/PP rank (rank 0 on the scheduler)."""
    if policy.chunk_tokens % shape.block_size:
        good = math.lcm(policy.chunk_tokens, shape.block_size)
        raise ConfigError(f"{policy.source}: chunk_tokens: {policy.chunk_tokens} is not a "
                          f"multiple of vLLM's block size {shape.block_size}; set chunk_tokens "
                          f"to a multiple of it (e.g. {good})")
    par = vllm_config.parallel_config
    layout = (f"{PAYLOAD_FORMATS[shape.kind]}:L{shape.num_layers}:H{shape.heads}"
              f":N{shape.block_size}:C{shape.content_bytes}")
    if shape.groups > 1:  # one engine's groups of one geometry are still others' blocks
        layout += f":G{shape.group}/{shape.groups}" + (f":W{shape.window}" if shape.window
                                                       else "")
    tp_rank, tp_size = (0, 1) if shape.tp_replicated else (tp_rank, par.tensor_parallel_size)
    return Namespace(model=policy.namespace.model or str(vllm_config.model_config.model),
                     dtype=shape.dtype, layout=layout, block_size=shape.block_size,
                     chunk_tokens=policy.chunk_tokens, tp_rank=tp_rank,
                     tp_size=tp_size, pp_rank=pp_rank,
                     pp_size=par.pipeline_parallel_size, tenant=policy.namespace.tenant)


def rank_namespace(ns: Namespace, tp_rank: int, pp_rank: int) -> Namespace:
    return replace(ns, tp_rank=tp_rank, pp_rank=pp_rank)


def check_layout(info: LayoutInfo, shape: KVShape) -> None:
    """Raise LayoutError if the worker's tensors do not match the namespace's geometry."""
    want = (shape.num_layers, shape.heads * shape.block_size * shape.content_bytes)
    got = (info.num_layers, info.page_bytes)
    if want != got:
        raise LayoutError(f"KV tensors hold {got[0]} layers x {got[1]} bytes per block, the KV "
                          f"cache config says {want[0]} x {want[1]}; kvtier cannot key these "
                          "blocks (report this layout to the kvtier maintainers)")


def rank_keys(keys: list[str], ns_fingerprint: str) -> list[str]:
    """`keys` (rank-0 namespace) re-prefixed with another rank's namespace fingerprint."""
    return [ns_fingerprint + k[NS_HEX:] for k in keys]


def request_salt(request: Any) -> bytes | None:
    """What besides the tokens changes this request's KV; None if it cannot be keyed."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    for f in getattr(request, "mm_features", None) or ():
        parts.append(f"mm={f.identifier}@{f.mm_position.offset}")
    return "\x1f".join(parts).encode()


def token_keys(ns: Namespace, tokens: Any, salt: bytes, after: str | None = None) -> list[str]:
    return block_keys(ns, tokens, salt, after)


def session_hint(request: Any) -> SessionHint | None:
    """The `{"kvtier": {...}}` part of the request's `kv_transfer_params`, if well formed."""
    params = getattr(request, "kv_transfer_params", None)
    raw = params.get("kvtier") if isinstance(params, dict) else None
    if raw is None:
        return None
    sid, gap = (raw.get("session_id"), raw.get("expected_gap_s")) if isinstance(raw, dict) \
        else (None, None)
    if not isinstance(raw, dict) or (sid is not None and not isinstance(sid, str)) or (
            gap is not None and (not isinstance(gap, (int, float)) or gap < 0)):
        log.warning("request %s: ignoring malformed kv_transfer_params.kvtier %r (expected "
                    "{'session_id': str, 'expected_gap_s': seconds >= 0})",
                    getattr(request, "request_id", "?"), raw)
        return None
    return SessionHint(session_id=sid, expected_gap_s=None if gap is None else float(gap))
