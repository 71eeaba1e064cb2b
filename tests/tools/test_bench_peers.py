"""`kvtier bench vllm --peers`: the harness that runs other connectors beside kvtier.

The engine test runs vLLM's MooncakeStoreConnector (it needs nothing beyond what kvtier
installs) beside vLLM alone at one small size; the long variant adds kvtier's engines and
goes through the command line; LMCache runs only where `make peers` built its venv.
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from kvtier.tools.bench import peers
from kvtier.tools.bench.peer_systems import PeerUnavailable, System
from kvtier.tools.bench.vllm import Result
from kvtier.tools.commands.bench_peers import render

N = 1024


def _run(system: str, cold, local, cross=(), cached=(0, N - 32, N - 32), tokens=None,
         decode=()):
    run = peers.Run(system, Result(N, {"cold": list(cold), "local": list(local),
                                       "cross": list(cross), "decode": list(decode)}))
    for case, values in zip(peers.CASES, (cold, local, cross)):
        run.cached[case] = [cached[peers.CASES.index(case)]] * len(values)
        run.tokens[case] = [tokens or [1, 2]] * len(values)
    return run


def test_outputs_are_checked_against_vllm_alone_and_hits_against_the_prompt():
    alone = _run("vllm-alone", [0.1], [0.1], cached=(0, 0, 0))
    good = _run("mooncake-store", [0.1], [0.01], [0.02])
    assert peers.mismatches([alone, good]) == [] and peers.missed_hits([alone, good]) == []
    wrong = _run("kvtier", [0.1], [0.01], [0.02], tokens=[1, 3])
    assert len(peers.mismatches([alone, wrong])) == 3
    missed = _run("kvtier", [0.1], [0.01], [0.02], cached=(0, N - 32, 0))
    assert peers.missed_hits([missed]) == [f"kvtier cross@{N} round 1: 0 of {N} tokens cached"]


def test_a_shorter_output_must_be_the_start_of_vllm_alones():
    alone = _run("vllm-alone", [0.1], [0.1], cached=(0, 0, 0), tokens=[1, 2, 3, 4])
    start = _run("kvtier", [0.1], [0.01], [0.02], tokens=[1, 2])
    assert peers.mismatches([alone, start]) == []
    other = _run("kvtier", [0.1], [0.01], [0.02], tokens=[1, 3])
    longer = _run("kvtier", [0.1], [0.01], [0.02], tokens=[1, 2, 3, 4, 5])
    assert len(peers.mismatches([alone, other])) == 3
    assert len(peers.mismatches([alone, longer])) == 3


class _Done:
    """What `Engine.submit` resolves to, as far as `measure` reads it."""

    def __init__(self, n: int):
        self.ttft_s, self.e2e_s, self.first_step, self.done_step = 0.5, 0.5 + 0.004 * (n - 1), \
            10, 10 + n - 1
        self.num_cached_tokens, self.served_tokens, self.token_ids = 0, 0, list(range(n))


class _Engine:
    def __init__(self):
        self.asked: list[int] = []

    def submit(self, prompt, max_tokens):
        from concurrent.futures import Future
        self.asked.append(max_tokens)
        fut = Future()
        fut.set_result(_Done(max_tokens))
        return fut

    def reset_prefix_cache(self) -> None:
        pass


def test_the_cold_request_times_its_decode_steps():
    system = type("S", (), {"engines": {"a": _Engine(), "b": _Engine()},
                            "settle": lambda self, prompt: None})()
    run = peers.Run("kvtier", Result(N, {c: [] for c in peers.ROWS}))
    peers.measure(system, [1] * N, run, max_tokens=4, decode_tokens=65)
    assert system.engines["a"].asked == [65, 4] and system.engines["b"].asked == [4]
    assert run.result.ttft_s["decode"] == [pytest.approx(0.004)]
    assert len(run.tokens["cold"][0]) == 65 and len(run.tokens["local"][0]) == 4
    step = peers.row(run, "decode")
    assert step["median_ms"] == pytest.approx(4.0) and "ttft_s" not in step
    off = peers.Run("kvtier", Result(N, {c: [] for c in peers.ROWS}))
    peers.measure(system, [1] * N, off, max_tokens=4)
    assert off.result.ttft_s["decode"] == []
    with pytest.raises(ValueError, match="2 tokens or more"):
        peers.PeersSpec(decode_tokens=1)


class _Host:
    """A host whose CPUs are busy for the first `busy_for` seconds of a fake clock."""

    def __init__(self, busy_for: float):
        self.t, self.busy_for, self.jiffies = 0.0, busy_for, [0, 0]

    def sleep(self, s: float) -> None:
        frac = 0.9 if self.t < self.busy_for else 0.05
        self.t += s
        self.jiffies[0] += round(100 * s * frac)
        self.jiffies[1] += round(100 * s)

    def sample(self) -> tuple[int, int]:
        return tuple(self.jiffies)


def test_each_turn_waits_for_a_quiet_host_and_no_longer_than_its_bound():
    busy = _Host(busy_for=1.0)
    waited = peers.wait_quiet(sample=busy.sample, clock=lambda: busy.t, sleep=busy.sleep)
    assert 1.3 <= waited <= 1.61  # 1 s busy (give or take a step), then 0.3 s quiet
    never = _Host(busy_for=1e9)
    assert peers.wait_quiet(timeout_s=2, sample=never.sample, clock=lambda: never.t,
                            sleep=never.sleep) == pytest.approx(2.0, abs=0.11)
    quiet = _Host(busy_for=0)
    assert peers.wait_quiet(sample=quiet.sample, clock=lambda: quiet.t,
                            sleep=quiet.sleep) == pytest.approx(0.3, abs=0.11)
    busy_jiffies, all_jiffies = peers.cpu_times()
    assert 0 <= busy_jiffies <= all_jiffies


def test_the_table_has_a_column_per_system_and_kvtier_over_each_other():
    runs = [_run("kvtier", [0.2], [0.01], [0.02], decode=[0.006]),
            _run("mooncake-store", [0.1], [0.02], [0.04], decode=[0.004]),
            _run("vllm-alone", [0.1], [0.1], cached=(0, 0, 0), decode=[0.003])]
    doc = {"spec": {"sizes": [N]}, "systems": [r.system for r in runs],
           "rows": [peers.row(r, c) for r in runs for c in peers.ROWS if r.result.ttft_s[c]]}
    console = Console(record=True, width=200)
    render(console, doc, "median", "t")
    text = console.export_text()
    assert "kvtier / mooncake-store" in text and "kvtier / vllm-alone" in text
    cross = next(line for line in text.splitlines() if "cross" in line)
    assert "20.0" in cross and "40.0" in cross and "0.50" in cross
    decode = next(line for line in text.splitlines() if "decode" in line)
    assert "6.00" in decode and "4.00" in decode and "1.50" in decode and "2.00" in decode


class _Fake(System):
    def start(self) -> None:
        self.engines = {"a": object()}

    def close(self) -> None:
        self.closed = True


class _Missing(_Fake):
    name = "lmcache"

    def prepare(self) -> None:
        raise PeerUnavailable("no LMCache venv at /x: run `make peers`")


def test_a_missing_peer_is_skipped_with_its_reason(tmp_path, monkeypatch):
    alone = type("Alone", (_Fake,), {"name": "vllm-alone"})
    monkeypatch.setattr(peers, "_systems", lambda spec: (
        [("lmcache", _Missing), ("vllm-alone", alone)], PeerUnavailable))
    monkeypatch.setattr(peers, "make_tiny_model", lambda path: path)
    started, skipped = peers.start_systems(peers.PeersSpec(peers=("lmcache",), kvtier=False),
                                           tmp_path, lambda msg: None)
    assert [s.name for s in started] == ["vllm-alone"]
    assert skipped == {"lmcache": "no LMCache venv at /x: run `make peers`"}


def test_the_lmcache_peer_says_how_to_build_it(tmp_path, monkeypatch):
    from kvtier.tools.bench.lmcache_peer import LMCache
    monkeypatch.setenv("KVTIER_PEERS_DIR", str(tmp_path))
    with pytest.raises(PeerUnavailable, match="make peers"):
        LMCache(tmp_path, peers.PeersSpec().bench_spec()).prepare()
    with pytest.raises(ValueError, match="unknown peer"):
        peers.PeersSpec(peers=("offloading",))


def test_the_lmcache_server_gets_the_pools_bytes():
    """The server reads `--l1-size-gb` in GiB: its L1 must be the pool the others get."""
    from kvtier.tools.bench.lmcache_peer import l1_size_arg
    for pool in (73_949_184, 443_694_592, 2 << 30, 1):
        assert int(float(l1_size_arg(pool)) * (1 << 30)) == pool


def _check(doc: dict, systems: list[str], decode: bool = False) -> None:
    assert doc["systems"] == systems and doc["mismatches"] == [] and doc["missed_hits"] == []
    rows = {(r["system"], r["case"]): r for r in doc["rows"]}
    for system in systems:
        cases = ("cold", "local") if system == "vllm-alone" else peers.CASES
        assert {c for s, c in rows if s == system} == set(cases) | ({"decode"} if decode
                                                                     else set())
        if decode:  # a decode step of the tiny model: well under its 1K-token prefill
            step = rows[system, "decode"]
            assert len(step["step_s"]) == 1 and 0 < step["median_ms"] < rows[system, "cold"][
                "median_ms"]
    for system in systems[:-1]:  # the connectors' reads found at least all but the last block
        for case in ("local", "cross"):
            assert N - 32 <= rows[system, case]["cached_tokens"][0] < N
        assert rows[system, "cold"]["cached_tokens"] == [0]


@pytest.mark.vllm
def test_mooncake_store_with_and_without_its_ssd_tier_beside_vllm_alone(tmp_path):
    pytest.importorskip("vllm")
    spec = peers.PeersSpec(sizes=(N,), repeats=1, kvtier=False, decode_tokens=16,
                           peers=("mooncake-store", "mooncake-store+ssd"),
                           quiet_wait_s=1)  # the suite keeps the host busy
    _check(peers.run_peers(spec, tmp_path, progress=lambda msg: None),
           ["mooncake-store", "mooncake-store+ssd", "vllm-alone"], decode=True)
    assert not list(tmp_path.rglob("mooncake-ssd"))  # the SSD tier's files go at close


@pytest.mark.vllm
@pytest.mark.slow
def test_the_command_runs_kvtier_and_the_peers_side_by_side(tmp_path):
    pytest.importorskip("vllm")
    from typer.testing import CliRunner

    from kvtier.tools.bench.lmcache_peer import peers_dir, venv_problem
    from kvtier.tools.cli import app
    wanted = "mooncake-store" + ("" if venv_problem(peers_dir() / "lmcache") else ",lmcache")
    res = CliRunner().invoke(app, ["bench", "vllm", "--peers", wanted, "--sizes", str(N),
                                   "--repeats", "1", "--dtype", "float32", "--decode", "8",
                                   "--dir",
                                   str(tmp_path / "run"), "--json", str(tmp_path / "p.json")],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    _check(json.loads((tmp_path / "p.json").read_text()),
           ["kvtier", *wanted.split(","), "vllm-alone"], decode=True)
    assert "decode" in res.output and "ms per step of 8 tokens" in res.output
