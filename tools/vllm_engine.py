"""Real vLLM engines for tests, benchmarks and replays: a tiny random model, one process each.

- `make_tiny_model(dir, kind)`: a 2-layer random model (`llama`, `mla`: a DeepSeek-V2 shape,
  `swa`: a Gemma 3 shape, `hybrid`: a Granite 4.0-H shape) saved with `save_pretrained`
  (no download), deterministic (seeded), so every process that builds it gets the same
  weights (`connector.harness.tiny_models`).
- `Engine`: a vLLM `LLM` in its own process (`python -m kvtier.connector.harness.engine_host SPEC`),
  driven by JSON lines. `submit` hands it one request at any time, without waiting: the
  engine runs it alongside the others as they come (continuous batching), and the returned
  `Future` resolves to a `Completion` (output token ids, cached tokens, the connector's
  `kv_transfer_params`, time to first token and to the last, measured inside the engine
  process from the moment it read the request); `on_first` is called at its first token.
  `generate` runs a batch to its end in one call and returns each request's output token ids,
  `num_cached_tokens` (local prefix hit + tokens a KV connector promised; `served_tokens`
  leaves out those kvtier promised and the engine then recomputed), the
  `kv_transfer_params` the connector returned, its time to first token from the batch's
  start (with `engine_args={"disable_log_stats": False}`), and the wall time. By default the engine
  runs in one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uni executor): scheduler and
  worker in one address space, which starts in seconds instead of a minute on small CPUs.
  `num_blocks` overrides the KV cache size (to force preemption); `engine_args` go to
  `LLM(...)` as they are (e.g. `async_scheduling`); `python` runs the engine under another
  interpreter (a venv with a peer connector installed beside vLLM); `dtype="float32"` keeps
  greedy outputs comparable across batch shapes (a random model's logits have near-ties
  that bf16 rounding flips: vLLM alone gives different tokens batched and unbatched).
- `kvtier_transfer_config(policy)`: the `--kv-transfer-config` for the kvtier connector;
  `prompt_keys(prompt, policy)`: the keys the connector gives the prompt's chunks;
  `random_prompt(seed, n)`: reproducible token ids.

Replies are JSON lines on a pipe of their own (so a chatty engine can never fill it and
block), read by one thread per engine that resolves submitted requests as their events come
and hands every other reply to the command waiting for it; everything the engine prints goes
to `log_path`. This module imports neither vLLM nor torch on the caller's side.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import random
import re
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvtier.connector.harness.tiny_models import (  # noqa: F401 (re-exported)
    BLOCK_SIZE, ENGINE_ARGS, MODEL_KINDS, RECURRENT_KINDS, TINY_MLA, TINY_MODEL, TINY_SWA,
    make_tiny_model)
from kvtier.store.base.config import kvtier_home

MAX_MODEL_LEN = 20480  # an engine's default longest prompt + output, in tokens


def logged_namespaces(log: str) -> dict[str, list[str]]:
    """{group kind: namespace fingerprints, in order} from the connector's start lines in
    an engine's `log` (one line per KV cache group when the engine keeps several)."""
    out: dict[str, list[str]] = {}
    for kind, fp in re.findall(r"kvtier: (\w+) group \d+: KV layout .* namespace (\w+)", log):
        if fp not in out.setdefault(kind, []):
            out[kind].append(fp)
    return out


def random_prompt(seed: int, n: int) -> list[int]:
    """`n` token ids drawn from the tiny model's vocabulary, reproducibly."""
    rng = random.Random(seed)
    return [rng.randrange(1, TINY_MODEL["vocab_size"]) for _ in range(n)]


def model_dir() -> Path:
    """Where the replay keeps its tiny random model (made once, reused by later runs)."""
    return kvtier_home() / "replay-model" / "tiny-llama"


def prompt_keys(prompt: list[int], policy: dict, dtype: str = "bfloat16",
                block_size: int = 32, kind: str = "llama", hybrid: bool = True) -> list[str]:
    """The kvtier keys of `prompt`'s full chunks, as KVTierConnector names them for the tiny
    model of `kind` served with `policy` (namespace.model set) at rank 0; `hybrid`: vLLM's
    hybrid memory allocator is on (a sliding-window model keeps two KV cache groups)."""
    from types import SimpleNamespace

    from kvtier.connector.naming import KVShape, make_namespace
    from kvtier.store.base.config import policy_from_dict
    from kvtier.store.base.keys import block_keys
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    if kind == "mla":  # one latent vector (kv_lora_rank + rope) per token
        m = TINY_MLA
        shape = KVShape(m["num_hidden_layers"], 1, block_size,
                        (m["kv_lora_rank"] + m["qk_rope_head_dim"]) * elem, dtype, "mla")
    elif kind == "swa" and not hybrid:  # one group: both layers, every token
        m = TINY_SWA
        shape = KVShape(m["num_hidden_layers"], m["num_key_value_heads"], block_size,
                        2 * m["head_dim"] * elem, dtype)
    elif kind == "swa":  # vLLM's hybrid allocator: [sliding-window, full]; the full one
        m = TINY_SWA      # is the group a hit's prefix is keyed by
        layers = m["layer_types"]
        shape = KVShape(layers.count("full_attention"), m["num_key_value_heads"], block_size,
                        2 * m["head_dim"] * elem, dtype, "full",
                        group=layers.index("full_attention"), groups=len(set(layers)))
    else:
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


class _Served:
    """What a cache served of a finished request's prompt (`Output`, `Completion`)."""

    num_cached_tokens: int
    kv_transfer_params: dict | None

    @property
    def served_tokens(self) -> int:
        """Prompt tokens served from a cache: `num_cached_tokens` less those the kvtier
        connector promised and the engine then recomputed (vLLM counts a token as cached
        when it schedules its load, and keeps counting it when the load fails)."""
        kv = (self.kv_transfer_params or {}).get("kvtier", {})
        return max(0, self.num_cached_tokens - int(kv.get("recomputed_tokens", 0)))


@dataclass
class Output(_Served):
    token_ids: list[int]
    num_cached_tokens: int
    kv_transfer_params: dict | None
    ttft_s: float | None = None  # from the batch's start; engines with disable_log_stats=False


@dataclass
class Completion(_Served):
    """A submitted request, done. Times in seconds from when the engine process read it."""
    id: str
    token_ids: list[int]
    num_cached_tokens: int
    kv_transfer_params: dict | None
    ttft_s: float               # to the end of the step that produced the first token
    e2e_s: float                # to the end of the step that produced the last one
    first_step: int             # the engine's step counter at the first token
    done_step: int              # ... and at the last
    added_s: float = 0.0        # waiting for the step in progress to end
    queued_s: float | None = None   # vLLM: queued to scheduled, KV loads included
    prefill_s: float | None = None  # vLLM: scheduled to first token
    preemptions: int | None = None  # (these three with disable_log_stats=False)


class EngineError(RuntimeError):
    """The engine process failed; the message ends with the tail of its log."""


class Engine:
    """One vLLM engine process. Use as a context manager or call `close()`."""

    def __init__(self, model: str | os.PathLike[str], log_path: str | os.PathLike[str], *,
                 kv_transfer_config: dict | None = None, block_size: int = 32,
                 max_model_len: int = MAX_MODEL_LEN, kv_cache_gib: int = 1,
                 num_blocks: int | None = None, dtype: str = "bfloat16", inproc: bool = True,
                 env: dict[str, str] | None = None, engine_args: dict | None = None,
                 startup_timeout_s: float = 600, prefix: list[str] | None = None,
                 python: str | None = None):
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
            # `prefix`: what runs the engine elsewhere (`ip netns exec HOST`: another host)
            self.proc = subprocess.Popen(
                [*(prefix or []), python or sys.executable, "-m",
                 "kvtier.connector.harness.engine_host",
                 json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                env=child_env, pass_fds=(wfd,), start_new_session=True)
        finally:
            os.close(wfd)
        self._replies = os.fdopen(rfd, "rb")
        self._lock = threading.Lock()        # one command waiting for its reply at a time
        self._write_lock = threading.Lock()  # whole lines on stdin
        self._sync: queue.Queue = queue.Queue()
        self._pending: dict[str, tuple[Future, Callable[[float], None] | None]] = {}
        self._ids = itertools.count()
        self._gone: str | None = None        # why the engine can take no more requests
        self.startup_s = self._read_startup(startup_timeout_s)["startup_s"]
        threading.Thread(target=self._pump, name=f"engine-{self.proc.pid}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def submit(self, prompt: list[int], max_tokens: int = 8, kv_params: dict | None = None,
               on_first: Callable[[float], None] | None = None) -> Future:
        """Send one greedy request now, without waiting; a `Future` of its `Completion`
        (or of an `EngineError`). `on_first(ttft_s)` runs on the reader thread at its first
        token. Requests run concurrently with each other (not with `generate`, which waits
        for them)."""
        rid = f"c{next(self._ids)}"
        fut: Future = Future()
        with self._write_lock:
            if self._gone is not None:
                raise EngineError(self._gone)
            self._pending[rid] = (fut, on_first)
            self._write({"op": "submit", "id": rid, "prompt": prompt,
                         "max_tokens": max_tokens, "kv_params": kv_params})
        return fut

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
        self._log.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, cmd: dict) -> None:
        if self.proc.poll() is not None:
            raise EngineError(f"engine exited with code {self.proc.returncode}"
                              f"{self.log_tail()}")
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise EngineError(f"engine closed its input{self.log_tail()}") from None

    def _call(self, cmd: dict, timeout_s: float) -> dict:
        """Send a command and wait for its reply; kills the engine after `timeout_s`."""
        with self._lock:
            with self._write_lock:
                self._write(cmd)
            try:
                reply = self._sync.get(timeout=timeout_s)
            except queue.Empty:
                self.proc.kill()
                reply = self._sync.get()  # the reader's end-of-replies, once it is dead
            return self._checked(reply, timeout_s)

    def _checked(self, reply: dict | None, timeout_s: float) -> dict:
        if reply is None:
            self.proc.wait()
            raise EngineError(f"engine exited with code {self.proc.returncode} (killed after "
                              f"{timeout_s:.0f}s if it hung){self.log_tail()}")
        if "error" in reply:
            raise EngineError(f"engine: {reply['error']}{self.log_tail()}")
        return reply

    def _read_startup(self, timeout_s: float) -> dict:
        timer = threading.Timer(timeout_s, self.proc.kill)
        timer.start()
        try:
            line = self._replies.readline()
        finally:
            timer.cancel()
        return self._checked(json.loads(line) if line else None, timeout_s)

    def _pump(self) -> None:
        """The reader thread: events resolve submitted requests, other replies go to the
        command waiting for them; at the end, everything still pending fails."""
        error = ""
        try:
            for line in self._replies:
                reply = json.loads(line)
                if "event" in reply:
                    self._event(reply)
                else:
                    error = reply.get("error", "")
                    self._sync.put(reply)
        finally:
            self._replies.close()
            self._sync.put(None)
            self._fail_pending(error)

    def _event(self, ev: dict) -> None:
        kind, rid = ev.pop("event"), ev["id"]
        if kind == "first":
            on_first = self._pending.get(rid, (None, None))[1]
            if on_first is not None:
                on_first(ev["ttft_s"])
            return
        fut, _ = self._pending.pop(rid)
        if kind == "failed":
            fut.set_exception(EngineError(f"engine refused request {rid}: {ev['error']}"))
        else:
            fut.set_result(Completion(**ev))

    def _fail_pending(self, error: str) -> None:
        self.proc.wait()
        with self._write_lock:
            self._gone = (f"engine exited with code {self.proc.returncode}"
                          f"{': ' + error if error else ''}{self.log_tail()}")
            pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            fut.set_exception(EngineError(self._gone))

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n--- engine log tail ---\n" + "\n".join(text)
