"""The README's serve recipe, run exactly as written: two servers on one node share one cache,
stop cleanly, and leave no file outside the policy's paths.

The recipe runs in a network namespace of its own (its ports, 8001, 8002 and the embedded
master's 50051, are then the test's alone) with a private tmpfs on /dev/shm (the segment
files), `HOME` in the test's temp dir, `MODEL` the tiny random model and `VLLM_ARGS` what a
model without a tokenizer needs. Needs root (namespaces, the mount).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from engine_util import full_block_tokens, make_tiny_model, random_prompt  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]  # two servers on two cores
README = Path(__file__).resolve().parents[2] / "README.md"
VLLM_ARGS = ("--skip-tokenizer-init --dtype float32 --block-size 32 --max-model-len 4096 "
             "--enforce-eager --seed 0 --enable-prompt-tokens-details")
START_S = 600
TOKENS = 8


def recipe(name: str) -> str:
    """The fenced block after `<!-- recipe: NAME -->` in the README."""
    text = README.read_text()
    m = re.search(rf"<!-- recipe: {name} -->\s*```bash\n(.*?)```", text, re.S)
    assert m, f"README has no recipe {name!r}"
    return m.group(1)


def in_ns(ns: str, code: str, timeout: float = 30) -> str:
    """Run Python `code` inside namespace `ns` (its loopback) and return what it prints."""
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise AssertionError(out.stderr[-2000:])
    return out.stdout


def request(ns: str, port: int, path: str, body: dict | None = None) -> dict | None:
    """GET (or POST `body` as JSON) inside the namespace; the reply, None if none came."""
    code = ("import json, sys, urllib.request\n"
            f"body = {json.dumps(json.dumps(body)) if body else 'None'}\n"
            f"req = urllib.request.Request('http://127.0.0.1:{port}{path}', "
            "body.encode() if body else None, {'Content-Type': 'application/json'})\n"
            "try:\n"
            "    with urllib.request.urlopen(req, timeout=120) as r:\n"
            "        print(r.read().decode() or '{}')\n"
            "except OSError:\n"
            "    print('null')\n")
    return json.loads(in_ns(ns, code, 180))


@pytest.fixture
def node(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: the recipe runs in a network namespace of its own")
    ns = f"kvt-readme-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
    home = tmp_path / "home"
    home.mkdir()
    groups: list[int] = []  # process groups of the servers (each with its engine processes)
    try:
        yield ns, home, groups
    finally:
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "delete", ns], check=False)


def test_the_readme_recipe_serves_two_engines_on_one_cache_and_stops_clean(node, tmp_path):
    ns, home, groups = node
    model = make_tiny_model(tmp_path / "tiny-llama")
    script = tmp_path / "recipe.sh"
    script.write_text(recipe("serve"))
    env = {**os.environ, "HOME": str(home), "MODEL": str(model), "VLLM_ARGS": VLLM_ARGS,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("KVTIER_HOME", None)
    # A private /dev/shm for the segment files, in the namespace's own mounts.
    ran = subprocess.run(["ip", "netns", "exec", ns, "bash", "-c",
                          f"mount -t tmpfs -o size=4g kvtier-test /dev/shm && "
                          f"setsid -w bash {script}"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    pid_files = sorted((home / "kvtier").glob("vllm-*.pid"))
    assert len(pid_files) == 2
    pids = [int(p.read_text()) for p in pid_files]
    groups += sorted({os.getpgid(p) for p in pids})
    deadline = time.monotonic() + START_S
    for port in (8001, 8002):
        while request(ns, port, "/health") is None:
            for pid in pids:
                assert _alive(pid), (home / "kvtier" / f"vllm-{port}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"server {port} did not start"
            time.sleep(2)

    prompt = random_prompt(51, 2000)
    body = {"model": str(model), "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "return_token_ids": True}
    first = request(ns, 8001, "/v1/completions", body)
    time.sleep(3)  # the first server saves into its segment after it answers
    second = request(ns, 8002, "/v1/completions", body)
    hits = second["kv_transfer_params"]["kvtier"]["hit_tokens"]
    assert hits.get("dram", 0) >= 0.9 * full_block_tokens(prompt) - 256, second
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]

    master = int((home / "kvtier" / "master.pid").read_text())
    groups.append(os.getpgid(master))
    stop = subprocess.run(["bash", "-c", recipe("stop")], env=env, timeout=300)
    assert stop.returncode == 0
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in [*pids, master]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_alive(p) for p in [*pids, master]), "something did not stop"
    for port in (8001, 8002):
        log = (home / "kvtier" / f"vllm-{port}.log").read_text(errors="replace")
        assert "kvtier: worker stopped in" in log, log[-3000:]
        # The engine stopped within its time: vLLM closes it before it cancels the task that
        # reads its outputs, so that task may still log an EngineDeadError after "MPClient:
        # complete" (the order of `AsyncLLM.shutdown`, not a failed stop); up to there, nothing.
        start = log.index("shutdown triggered")
        assert "MPClient: complete" in log[start:], log[-3000:]
        stopping = log[start:log.index("MPClient: complete", start)]
        for noise in ("still running after", "EngineDeadError", "Traceback", "force kill"):
            assert noise not in stopping, f"{noise!r} at stop:\n{stopping[-3000:]}"
    # Everything kvtier wrote is under the policy's paths (~/kvtier); nothing in
    # $KVTIER_HOME's default place or the temp dir.
    assert not (home / ".cache" / "kvtier").exists()
    written = {p.relative_to(home).parts[0] for p in home.rglob("*") if "kvtier" in p.name}
    assert written == {"kvtier"}, written


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
