"""The vLLM side of `tools.vllm_engine.Engine`: one vLLM `LLM` in its own process, and the
tiny random model tests, benchmarks and replays serve.

`python -m kvtier.connector.engine_host SPEC` builds `LLM(**SPEC)` (token-id prompts, no
tokenizer, prefix caching on, greedy), replies `{"startup_s"}` on the reply fd named in
SPEC, then serves JSON-line commands from stdin (`generate`, `reset_prefix_cache`, `quit`),
one JSON reply each. It lives here because `connector/` is the only package that imports
vLLM (and torch, for the model's weights); the caller's side (`tools.vllm_engine`) imports
neither.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TINY_MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
                  initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_tiny_model(path: str | os.PathLike[str], **overrides: Any) -> Path:
    """Build (once) the tiny random Llama under `path`; returns the path."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_MODEL, **overrides})).to(torch.bfloat16)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path



_REPLIES = None


def _reply(obj: dict) -> None:
    _REPLIES.write(json.dumps(obj) + "\n")
    _REPLIES.flush()


def _serve(spec: dict) -> None:
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"], seed=0,
        enforce_eager=True, enable_prefix_caching=True, block_size=spec["block_size"],
        max_model_len=spec["max_model_len"])
    if spec["inproc"]:
        kwargs["distributed_executor_backend"] = "uni"
    if spec.get("num_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(**{**kwargs, **spec.get("engine_args", {})})
    _reply({"startup_s": time.perf_counter() - t0})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            # Shut the engine down here, so connectors finish their queued work (saves)
            # before the process exits.
            llm.llm_engine.engine_core.shutdown()
            _reply({"bye": True})
            return
        if cmd["op"] == "reset_prefix_cache":
            _reply({"ok": llm.reset_prefix_cache()})
            continue
        params = cmd.get("kv_params") or [None] * len(cmd["prompts"])
        sps = [SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True,
                              extra_args={"kv_transfer_params": p} if p else None)
               for p in params]
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], sps,
                            use_tqdm=False)
        elapsed = time.perf_counter() - t
        _reply({"elapsed_s": elapsed, "outputs": [
            {"token_ids": list(o.outputs[0].token_ids),
             "num_cached_tokens": o.num_cached_tokens or 0,
             "kv_transfer_params": o.kv_transfer_params,
             "ttft_s": getattr(o.metrics, "first_token_latency", None)} for o in outs]})


def main() -> None:
    global _REPLIES
    spec = json.loads(sys.argv[1])
    _REPLIES = os.fdopen(spec["reply_fd"], "w")
    try:
        _serve(spec)
    except Exception as e:  # report to the parent in one line; the traceback goes to the log
        import traceback
        traceback.print_exc()
        _reply({"error": f"{type(e).__name__}: {e}"})
        sys.exit(1)


if __name__ == "__main__":
    main()
