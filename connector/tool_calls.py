"""Which turns end on a tool call: the model's tool-call tokens, and the gap class they give.

A session waits seconds for a tool and minutes for a person, and the store learns one gap
distribution per class (store/session_stats). The scheduler side learns the class from the
request's output: a turn whose output holds one of the model's tool-call tokens waits for a
tool. `tool_call_token_ids: auto` (the default) finds those tokens in the model's tokenizer
by name; a list of ids sets them by hand; an empty list turns the classes off.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

log = logging.getLogger(__name__)

# Tokens that, in their model family's chat format, are emitted only by a turn that calls a
# tool. Each counts only where the tokenizer holds it as one token (an added or special
# token), so a family without it is unaffected. Llama 3's JSON tool calls carry no such
# token (only its built-in tools do); set those ids by hand if the model has others.
TOOL_CALL_MARKERS = (
    "<tool_call>",                     # Qwen2.5/3, Hermes, GLM-4.5, Granite 4
    "<|python_tag|>", "<|eom_id|>",    # Llama 3.1+ built-in tools
    "[TOOL_CALLS]",                    # Mistral
    "<｜tool▁calls▁begin｜>",          # DeepSeek V3, R1, V3.1
    "<|tool_calls_section_begin|>",    # Kimi K2
    "<|tool_call|>",                   # Granite 3, Phi-4-mini
    "<|tool_call_start|>",             # LFM2
    "<minimax:tool_call>",             # MiniMax M2
    "<|call|>",                        # gpt-oss (harmony): ends a tool call
    "<start_function_call>",           # FunctionGemma
)


def tool_call_ids(vocab: Mapping[str, int], markers: Iterable[str] = TOOL_CALL_MARKERS
                  ) -> dict[str, int]:
    """The markers the vocabulary holds as single tokens, with their ids."""
    return {m: vocab[m] for m in markers if isinstance(vocab.get(m), int)}


def detect_tool_call_ids(model_config: Any) -> frozenset[int]:
    """The tool-call token ids of the served model's tokenizer (empty when it has none, or
    the engine runs without a tokenizer). Never raises: a tokenizer that cannot be read
    costs the gap classes, not the engine."""
    if getattr(model_config, "skip_tokenizer_init", True) or not getattr(
            model_config, "tokenizer", None):
        log.info("kvtier: no tokenizer (skip_tokenizer_init): turns are not told apart by "
                 "tool calls; set tool_call_token_ids to the model's tool-call token ids")
        return frozenset()
    try:
        from vllm.tokenizers import cached_tokenizer_from_config
        vocab = cached_tokenizer_from_config(model_config).get_vocab()
    except Exception as e:  # noqa: BLE001 - any failure only loses the classes
        log.warning("kvtier: could not read the tokenizer's vocabulary (%s: %s); turns are "
                    "not told apart by tool calls; set tool_call_token_ids by hand",
                    type(e).__name__, e)
        return frozenset()
    found = tool_call_ids(vocab)
    if found:
        log.info("kvtier: turns whose output holds %s wait for a tool",
                 ", ".join(f"{m} ({i})" for m, i in found.items()))
    else:
        log.info("kvtier: the tokenizer has no known tool-call token: every turn is one gap "
                 "class; set tool_call_token_ids to the model's tool-call token ids")
    return frozenset(found.values())


def gap_class(request: Any, ids: frozenset[int]) -> str | None:
    """What the session waits for once this request is done: `"tool"` when the output holds
    one of the model's tool-call tokens, else `"user"`; None when there are none (the
    store then learns one gap distribution for every turn)."""
    if not ids:
        return None
    out = getattr(request, "output_token_ids", None) or ()
    return "tool" if not ids.isdisjoint(out) else "user"
