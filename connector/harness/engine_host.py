"""The vLLM side of `tools.vllm_engine.Engine`: one vLLM `LLM` in its own process (serving
the tiny random models of `tiny_models`).

`python -m kvtier.connector.harness.engine_host SPEC` builds `LLM(**SPEC)` (token-id prompts, no
tokenizer, prefix caching on, greedy), replies `{"startup_s"}` on the reply fd named in
SPEC, then serves JSON-line commands from stdin. It lives here because `connector/` is the
only package that imports vLLM (and torch, for the model's weights); the caller's side
(`tools.vllm_engine`) imports neither.

Commands, in the order they arrive:
- `generate` (a batch: `LLM.generate`, one reply when all of it is done), `reset_prefix_cache`,
  `quit`: one JSON reply each, as before. A `generate` waits for the submitted requests
  still running to finish first (`LLM.generate` steps the engine until it has nothing left).
- `submit` (`id`, `prompt`, `max_tokens`, `kv_params`): no reply of its own. The request
  joins the running engine at the next step (continuous batching, as behind `vllm serve`:
  vLLM's scheduler admits it within its limits, alongside the requests already running),
  and the host reports events as they happen, each a line with `event` set:
  `first` (`id`, `ttft_s`, `step`) at the step that produced its first token, then `done`
  (`id`, `token_ids`, `num_cached_tokens`, `kv_transfer_params`, `ttft_s`, `e2e_s`,
  `first_step`, `done_step`, `added_s`, and vLLM's `queued_s`/`prefill_s`/`preemptions`
  when it logs stats), or `failed` (`id`, `error`) if vLLM refused it.

Times are taken in this process: `ttft_s` and `e2e_s` run from the moment the command was
read (a reader thread stamps each line), so waiting for the step in progress and any queueing
inside vLLM count, as they would for a client of `vllm serve`. `added_s` is the wait for the
step boundary, `queued_s` vLLM's wait from queued to scheduled (remote KV loads included),
`prefill_s` scheduled to first token.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IDLE_PAUSE_S = 0.001  # after a step that ran nothing (e.g. all waiting for KV loads)


_REPLIES = None


def _reply(obj: dict) -> None:
    _REPLIES.write(json.dumps(obj) + "\n")
    _REPLIES.flush()


@dataclass
class _Live:
    """A submitted request while it runs (times: `time.perf_counter()`)."""
    arrival: float
    added: float
    tokens: list[int] = field(default_factory=list)
    first: float | None = None
    first_step: int = 0


class _Host:
    """Serves commands while stepping the engine whenever submitted requests are live."""

    def __init__(self, llm):
        self.llm, self.engine = llm, llm.llm_engine
        self.commands: queue.Queue = queue.Queue()
        self.live: dict[str, _Live] = {}
        self.steps = 0
        threading.Thread(target=self._read_stdin, name="engine-host-stdin", daemon=True).start()

    def _read_stdin(self) -> None:
        for line in sys.stdin:
            self.commands.put((time.perf_counter(), json.loads(line)))
        self.commands.put((time.perf_counter(), None))  # EOF: the caller is gone

    def run(self) -> None:
        pause: float | None = None
        while True:
            for arrival, cmd in self._take(None if not self.live else pause):
                if cmd is None or not self._handle(arrival, cmd):
                    return
            pause = self._step() if self.live else None

    def _take(self, timeout: float | None) -> list:
        """Every command waiting; blocks for the first when `timeout` is None (nothing
        runs), waits up to `timeout` for one otherwise."""
        out = []
        try:
            out.append(self.commands.get(timeout=timeout) if timeout != 0
                       else self.commands.get_nowait())
            while True:
                out.append(self.commands.get_nowait())
        except queue.Empty:
            return out

    def _handle(self, arrival: float, cmd: dict) -> bool:
        op = cmd["op"]
        if op == "submit":
            self._submit(arrival, cmd)
        elif op == "quit":
            # Shut the engine down here, so connectors finish their queued work (saves)
            # before the process exits.
            self.engine.engine_core.shutdown()
            _reply({"bye": True})
            return False
        elif op == "reset_prefix_cache":
            _reply({"ok": self._reset_prefix_cache()})
        else:
            while self.live:  # LLM.generate would step (and swallow) the submitted ones
                self._step()
            _reply(_generate(self.llm, cmd))
        return True

    def _reset_prefix_cache(self, timeout_s: float = 60) -> bool:
        """Reset vLLM's prefix cache once no finished request holds blocks. A connector
        that saves after the request ends (MooncakeStore) keeps its blocks until it reports
        the save done, which vLLM learns at a step; `vllm serve` steps all the time, this
        host only while requests run, so it steps the idle engine here (in one process;
        a multi-process engine's core steps by itself)."""
        deadline = time.monotonic() + timeout_s
        while not self.llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                return False
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
                self._step()  # reports what submitted requests produce, as the loop does
            time.sleep(0.01)
        return True

    def _submit(self, arrival: float, cmd: dict) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        p = cmd.get("kv_params")
        sp = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA,
                            extra_args={"kv_transfer_params": p} if p else None)
        try:
            # rendered by the engine's renderer, as add_request asks (LLM.generate does too)
            (prompt,) = self.engine.renderer.render_cmpl(
                [TokensPrompt(prompt_token_ids=cmd["prompt"])])
            self.engine.add_request(cmd["id"], prompt, sp)
        except Exception as e:  # vLLM refused this request (too long, bad params): say so
            _reply({"event": "failed", "id": cmd["id"], "error": f"{type(e).__name__}: {e}"})
            return
        self.live[cmd["id"]] = _Live(arrival, time.perf_counter())

    def _step(self) -> float:
        """One engine step; reports first tokens and completions. Returns how long to wait
        for a command before the next step (a step that produced nothing, quickly, is the
        engine waiting on KV loads: spinning would take the CPU from them)."""
        t = time.perf_counter()
        outs = self.engine.step()
        now = time.perf_counter()
        self.steps += 1
        for o in outs:
            r = self.live.get(o.request_id)
            if r is None:
                continue
            new = list(o.outputs[0].token_ids) if o.outputs else []
            if new and r.first is None:
                r.first, r.first_step = now, self.steps
                _reply({"event": "first", "id": o.request_id, "ttft_s": now - r.arrival,
                        "step": self.steps})
            r.tokens.extend(new)
            if o.finished:
                del self.live[o.request_id]
                _reply(_done(o, r, now, self.steps))
        return IDLE_PAUSE_S if not outs and now - t < 2 * IDLE_PAUSE_S else 0


def _done(o, r: _Live, now: float, step: int) -> dict:
    first = r.first if r.first is not None else now
    reply = {"event": "done", "id": o.request_id, "token_ids": r.tokens,
             "num_cached_tokens": o.num_cached_tokens or 0,
             "kv_transfer_params": o.kv_transfer_params, "ttft_s": first - r.arrival,
             "e2e_s": now - r.arrival, "first_step": r.first_step or step, "done_step": step,
             "added_s": r.added - r.arrival}
    m = o.metrics
    if m is not None and getattr(m, "scheduled_ts", 0):
        reply.update(queued_s=m.scheduled_ts - m.queued_ts,
                     prefill_s=m.first_token_ts - m.scheduled_ts,
                     preemptions=m.num_preemptions)
    return reply


def _generate(llm, cmd: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = cmd.get("kv_params") or [None] * len(cmd["prompts"])
    sps = [SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True,
                          extra_args={"kv_transfer_params": p} if p else None)
           for p in params]
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], sps,
                        use_tqdm=False)
    elapsed = time.perf_counter() - t
    return {"elapsed_s": elapsed, "outputs": [
        {"token_ids": list(o.outputs[0].token_ids),
         "num_cached_tokens": o.num_cached_tokens or 0,
         "kv_transfer_params": o.kv_transfer_params,
         "ttft_s": getattr(o.metrics, "first_token_latency", None)} for o in outs]}


def _serve(spec: dict) -> None:
    t0 = time.perf_counter()
    from vllm import LLM
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
    _Host(llm).run()


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
