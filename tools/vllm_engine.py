"""Real vLLM engines for tests, benchmarks and replays: a tiny random model, one process each.

- `make_tiny_model(dir)`: a 2-layer random Llama saved with `save_pretrained` (no download),
  deterministic (seeded), so every process that builds it gets the same weights.
- `Engine`: a vLLM `LLM` in its own process (`python -m kvtier.connector.engine_host SPEC`),
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.connector.engine_host import TINY_MODEL, make_tiny_model  # noqa: F401 (re-exported)

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
                [sys.executable, "-m", "kvtier.connector.engine_host", json.dumps(spec)],
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
