"""Real vLLM engines for tests, benchmarks and replays: a tiny random model, one process each.

- `make_tiny_model(dir)`: a 2-layer random Llama saved with `save_pretrained` (no download),
  deterministic (seeded), so every process that builds it gets the same weights.
- `Engine`: a vLLM `LLM` in its own process (`python -m kvtier.tools.vllm_engine SPEC`),
  driven by JSON lines; `generate` returns each request's output token ids,
  `num_cached_tokens` (local prefix hit + tokens loaded by a KV connector), the
  `kv_transfer_params` the connector returned, its time to first token from the batch's
  start (with `engine_args={"disable_log_stats": False}`), and the wall time. By default the engine
  runs in one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uni executor): scheduler and
  worker in one address space, which starts in seconds instead of a minute on small CPUs.
  `num_blocks` overrides the KV cache size (to force preemption); `engine_args` go to
  `LLM(...)` as they are (e.g. `async_scheduling`); `dtype="float32"` keeps
  greedy outputs comparable across batch shapes (a random model's logits have near-ties
  that bf16 rounding flips: vLLM alone gives different tokens batched and unbatched).
- `kvtier_transfer_config(policy)`: the `--kv-transfer-config` for the kvtier connector;
  `prompt_keys(prompt, policy)`: the keys the connector gives the prompt's chunks;
  `random_prompt(seed, n)`: reproducible token ids.

Replies are JSON lines on a pipe of their own (so a chatty engine can never fill it and
block); everything the engine prints goes to `log_path`. This module imports neither vLLM
nor torch on the caller's side.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
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


def random_prompt(seed: int, n: int) -> list[int]:
    """`n` token ids drawn from the tiny model's vocabulary, reproducibly."""
    rng = random.Random(seed)
    return [rng.randrange(1, TINY_MODEL["vocab_size"]) for _ in range(n)]


def prompt_keys(prompt: list[int], policy: dict, dtype: str = "bfloat16",
                block_size: int = 32) -> list[str]:
    """The kvtier keys of `prompt`'s full chunks, as KVTierConnector names them for the tiny
    model served with `policy` (namespace.model set) at rank 0."""
    from types import SimpleNamespace

    from kvtier.connector.naming import KVShape, make_namespace
    from kvtier.store.config import policy_from_dict
    from kvtier.store.keys import block_keys
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    head = TINY_MODEL["hidden_size"] // TINY_MODEL["num_attention_heads"]
    shape = KVShape(TINY_MODEL["num_hidden_layers"], TINY_MODEL["num_key_value_heads"],
                    block_size, 2 * head * elem, dtype)
    config = SimpleNamespace(model_config=SimpleNamespace(model=policy["namespace"]["model"]),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                             pipeline_parallel_size=1))
    ns = make_namespace(config, shape, policy_from_dict(policy))
    return block_keys(ns, prompt, b"")


def kvtier_transfer_config(policy: dict | str | None = None, **extra: Any) -> dict:
    """The kv-transfer-config dict for KVTierConnector (policy inline, as a path, or default)."""
    cfg: dict[str, Any] = dict(extra)
    if isinstance(policy, dict):
        cfg["policy"] = policy
    elif policy is not None:
        cfg["kvtier_config"] = str(policy)
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": cfg}


@dataclass
class Output:
    token_ids: list[int]
    num_cached_tokens: int
    kv_transfer_params: dict | None
    ttft_s: float | None = None  # from the batch's start; engines with disable_log_stats=False


class EngineError(RuntimeError):
    """The engine process failed; the message ends with the tail of its log."""


class Engine:
    """One vLLM engine process. Use as a context manager or call `close()`."""

    def __init__(self, model: str | os.PathLike[str], log_path: str | os.PathLike[str], *,
                 kv_transfer_config: dict | None = None, block_size: int = 32,
                 max_model_len: int = 20480, kv_cache_gib: int = 1,
                 num_blocks: int | None = None, dtype: str = "bfloat16", inproc: bool = True,
                 env: dict[str, str] | None = None, engine_args: dict | None = None,
                 startup_timeout_s: float = 600):
        self.log_path = Path(log_path)
        spec = {"model": str(model), "kv_transfer_config": kv_transfer_config,
                "block_size": block_size, "max_model_len": max_model_len, "inproc": inproc,
                "num_blocks": num_blocks, "dtype": dtype, "engine_args": engine_args or {}}
        child_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                     "PYTHONUNBUFFERED": "1", **(env or {})}
        if inproc:
            child_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self._log = open(self.log_path, "ab")
        rfd, wfd = os.pipe()
        spec["reply_fd"] = wfd
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.tools.vllm_engine", json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                env=child_env, pass_fds=(wfd,), start_new_session=True)
        finally:
            os.close(wfd)
        self._replies = os.fdopen(rfd, "rb")
        self._lock = threading.Lock()
        self.startup_s = self._read(startup_timeout_s)["startup_s"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def generate(self, prompts: list[list[int]], max_tokens: int = 8,
                 kv_params: list[dict | None] | None = None, timeout_s: float = 600,
                 ) -> tuple[list[Output], float]:
        """Greedy generation of every prompt in one batch; (outputs, wall seconds)."""
        reply = self._call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                            "kv_params": kv_params}, timeout_s)
        return [Output(**o) for o in reply["outputs"]], reply["elapsed_s"]

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's local prefix cache, so the next hits must come from the connector."""
        if not self._call({"op": "reset_prefix_cache"}, 120)["ok"]:
            raise EngineError("vLLM refused to reset its prefix cache (blocks still held by a "
                              f"request or a connector){self.log_tail()}")

    def close(self, timeout_s: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                self._call({"op": "quit"}, timeout_s)
            except EngineError:
                pass  # already reported through the log; make sure it is gone below
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._replies.close()
        self._log.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, cmd: dict, timeout_s: float) -> dict:
        with self._lock:
            if self.proc.poll() is not None:
                raise EngineError(f"engine exited with code {self.proc.returncode}"
                                  f"{self.log_tail()}")
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
            return self._read(timeout_s)

    def _read(self, timeout_s: float) -> dict:
        """The next reply; fails when the engine exits, and kills it after `timeout_s`."""
        timer = threading.Timer(timeout_s, self.proc.kill)
        timer.start()
        try:
            line = self._replies.readline()
        finally:
            timer.cancel()
        if not line:
            self.proc.wait()
            raise EngineError(f"engine exited with code {self.proc.returncode} (killed after "
                              f"{timeout_s:.0f}s if it hung){self.log_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"engine: {reply['error']}{self.log_tail()}")
        return reply

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n--- engine log tail ---\n" + "\n".join(text)


# ---- the child process ------------------------------------------------------------------

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
