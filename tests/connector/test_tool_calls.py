"""Which turns wait for a tool: the tool-call tokens found in a real tokenizer (saved beside
the tiny model and read through vLLM's own model config), and the class a turn's output
gives."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.tokenizers")

from kvtier.connector.tool_calls import (TOOL_CALL_MARKERS, detect_tool_call_ids,  # noqa: E402
                                         gap_class, tool_call_ids)

from engine_util import make_tiny_model, save_tokenizer  # noqa: E402


def model_config(path, **over):
    from vllm.config import ModelConfig
    return ModelConfig(model=str(path), dtype="bfloat16", **over)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tool_calls") / "model")


def test_the_tokenizers_tool_call_tokens_are_found_by_name(model_dir, caplog):
    vocab = save_tokenizer(model_dir, ["<tool_call>", "</tool_call>", "<|eom_id|>", "<think>"])
    with caplog.at_level(logging.INFO, logger="kvtier.connector.tool_calls"):
        ids = detect_tool_call_ids(model_config(model_dir))
    assert ids == {vocab["<tool_call>"], vocab["<|eom_id|>"]}
    assert vocab["</tool_call>"] not in ids and vocab["<think>"] not in ids
    assert f"<tool_call> ({vocab['<tool_call>']})" in caplog.text


def test_no_tool_call_token_or_no_tokenizer_leaves_one_class(tmp_path, model_dir, caplog):
    plain = make_tiny_model(tmp_path / "plain")
    save_tokenizer(plain, ["<think>"])
    with caplog.at_level(logging.INFO, logger="kvtier.connector.tool_calls"):
        assert detect_tool_call_ids(model_config(plain)) == frozenset()
        assert "no known tool-call token" in caplog.text
        assert detect_tool_call_ids(model_config(model_dir, skip_tokenizer_init=True)) == \
            frozenset()
        assert "skip_tokenizer_init" in caplog.text


def test_an_unreadable_tokenizer_costs_the_classes_not_the_engine(tmp_path, caplog):
    corrupt = make_tiny_model(tmp_path / "corrupt")
    save_tokenizer(corrupt, ["<tool_call>"])
    (corrupt / "tokenizer.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kvtier.connector.tool_calls"):
        assert detect_tool_call_ids(model_config(corrupt)) == frozenset()
    assert "could not read the tokenizer" in caplog.text and "by hand" in caplog.text


def test_only_markers_held_as_one_token_count():
    vocab = {"<tool_call>": 5, "<|call|>": 9, "hello": 1}
    assert tool_call_ids(vocab) == {"<tool_call>": 5, "<|call|>": 9}
    assert tool_call_ids({"hello": 1}) == {}
    assert len(set(TOOL_CALL_MARKERS)) == len(TOOL_CALL_MARKERS)


def request(**fields):
    return SimpleNamespace(request_id="r", **fields)


def test_a_turn_that_ended_on_a_tool_call_waits_for_the_tool():
    tools = frozenset({7, 9})
    assert gap_class(request(output_token_ids=[1, 2, 9, 3]), tools) == "tool"
    assert gap_class(request(output_token_ids=[1, 2, 3]), tools) == "user"
    assert gap_class(request(output_token_ids=[1, 9]), frozenset()) is None
    assert gap_class(request(), tools) == "user"   # nothing generated
