"""`kvtier bench failover`: how long the pool is gone when its master is lost, with and
without Mooncake's HA mode, measured through kvtier's own mooncake tier.

- `ha`: a local etcd and two masters joined in one election (as `kvtier master --ha` starts
  them), and one mooncake tier on `etcd://...` holding `old` blocks. The leader is SIGKILLed
  `kills` times, `SETTLE_S` after the last put; once the client works again the killed
  master is started again on its address and stands by, so every kill finds a standby.
- `single`: one master without HA, SIGKILLed and started again at once on its address
  (its own start counts, as an operator's restart would).

After each kill a put of a new block, and a get of it, are tried every `POLL_S`: the row
records the seconds from the kill to the first put and to the first get that succeeded,
and how many old blocks still read back (verified frames: a wrong byte is a miss).

Each mode runs in a child process (`python -m kvtier.tools.bench.failover --mode ...`) that
prints its rows as JSON and leaves with `os._exit`: tearing down a Mooncake 0.3.13 client
of HA masters takes ~30 s (its destructor joins a thread blocked in an etcd watch, holding
the GIL), and the master drops a client that stopped pinging after its `client_ttl` anyway.
The child's servers die with it (`die_with_parent`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.store.base import block
from kvtier.store.base.config import MasterConfig, MooncakeTierConfig
from kvtier.store.base.errors import KVTierError
from kvtier.store.base.index import Index
from kvtier.store.base.keys import Namespace, id_chain_hashes, make_keys
from kvtier.tiers import MISS, Tier, TierContext, open_tier
from kvtier.tiers.mooncake import ha
from kvtier.tiers.mooncake.master import EmbeddedMaster, free_port
from kvtier.tools.etcd import LocalEtcd

POLL_S = 0.05
# Seconds between the last put and a leader's kill: the leader writes its op log to etcd in
# batches, and blocks put less than ~1 s before it dies can be missing on the next leader
# (measured: 4 of 8 kills right after the puts lost most of them, 0 of 5 after 1-3 s).
SETTLE_S = 2.0
PAYLOAD = 64 << 10
NS = Namespace(model="kvtier-bench-failover").fingerprint()
# Tiers a run leaves open for the child's os._exit: dropping the last reference would run
# Mooncake's client destructor, the ~30 s teardown the child exists to skip.
_LEFT_OPEN: list[Tier] = []


@dataclass
class Recovery:
    """One kill: seconds to the first working put and get, old blocks kept of `old`."""

    mode: str
    kill: int
    put_s: float | None
    get_s: float | None
    old_kept: int
    old: int


def keys(tag: str, n: int) -> list[str]:
    return make_keys(NS, id_chain_hashes(range(n), salt=tag.encode()))


def frame(key: str) -> memoryview:
    buf = block.alloc_aligned(block.HEADER_SIZE + PAYLOAD)
    buf[block.HEADER_SIZE:block.HEADER_SIZE + 8] = key[-8:].encode()
    block.seal(buf, key, PAYLOAD)
    return buf


def open_pool(root: Path, master: MasterConfig) -> Tier:
    """A mooncake tier as an engine's worker has it (it lends a 64 MiB segment)."""
    cfg = MooncakeTierConfig(kind="mooncake", name="dram", capacity="64MiB", buffer="16MiB",
                             staging="16MiB")
    index = Index(root / "index", map_size_bytes=64 << 20)
    tier = open_tier(cfg, TierContext(index, "bench-node", master))
    tier.bench_index = index  # type: ignore[attr-defined]
    _LEFT_OPEN.append(tier)
    return tier


def read_back(tier: Tier, names: list[str]) -> int:
    """How many of `names` the tier serves (each frame verified by the tier)."""
    outs = [block.alloc_aligned(block.HEADER_SIZE + PAYLOAD) for _ in names]
    try:
        return sum(n != MISS for n in tier.get(names, outs))
    except KVTierError:
        return 0


def until_working(tier: Tier, t0: float, tag: str, timeout_s: float) -> tuple:
    """(seconds from `t0` to the first put that succeeds, to the first get of it)."""
    put_s = get_s = None
    i = 0
    while time.monotonic() - t0 < timeout_s and get_s is None:
        key = keys(f"{tag}-{i}", 1)
        i += 1
        try:
            stored = tier.put(key, [frame(key[0])])[0]
        except KVTierError:
            stored = False
        if stored:
            put_s = put_s if put_s is not None else time.monotonic() - t0
            if read_back(tier, key) == 1:
                get_s = time.monotonic() - t0
        if get_s is None:
            time.sleep(POLL_S)
    return put_s, get_s


def fill(tier: Tier, n: int) -> list[str]:
    old = keys("old", n)
    if not all(tier.put(old, [frame(k) for k in old])):
        raise KVTierError("the pool refused the old blocks before any kill")
    return old


def measure_ha(root: Path, kills: int, n_old: int = 32, timeout_s: float = 60.0,
               etcd: LocalEtcd | None = None) -> list[Recovery]:
    """Kill the HA leader `kills` times under one client; see the module docstring."""
    own_etcd = etcd is None
    etcd = etcd or LocalEtcd(root / "etcd").start()
    cfgs = [MasterConfig(address=f"127.0.0.1:{free_port()}", etcd=[etcd.endpoint],
                         start_timeout_s=30) for _ in range(2)]
    masters = {c.address: EmbeddedMaster(c, log_path=root / f"master-{c.port}.log").start()
               for c in cfgs}
    client_cfg = MasterConfig(etcd=[etcd.endpoint])
    tier = open_pool(root, client_cfg)
    rows = []
    try:
        old = fill(tier, n_old)
        for n in range(kills):
            time.sleep(SETTLE_S)
            leader = ha.current_leader(client_cfg.etcd)
            victim = masters[leader.address]
            victim.kill()
            t0 = time.monotonic()
            put_s, get_s = until_working(tier, t0, f"ha{n}", timeout_s)
            rows.append(Recovery("ha", n + 1, put_s, get_s, read_back(tier, old), len(old)))
            if get_s is None:
                break
            masters[victim.cfg.address] = EmbeddedMaster(
                victim.cfg, log_path=root / f"master-{victim.cfg.port}-{n}.log").start()
    finally:  # the tier stays open: the child leaves with os._exit (module docstring)
        tier.bench_index.close()  # type: ignore[attr-defined]
        for m in masters.values():
            m.stop()
        if own_etcd:
            etcd.stop()
    return rows


def measure_single(root: Path, kills: int, n_old: int = 32,
                   timeout_s: float = 60.0) -> list[Recovery]:
    """Kill the one master (no HA) `kills` times, restarting it at once each time."""
    cfg = MasterConfig(address=f"127.0.0.1:{free_port()}", embedded=False)
    master = EmbeddedMaster(cfg, log_path=root / "master-single.log").start()
    tier = open_pool(root, cfg)
    rows = []
    try:
        old = fill(tier, n_old)
        for n in range(kills):
            master.kill()
            t0 = time.monotonic()
            master = EmbeddedMaster(cfg, log_path=root / f"master-single-{n}.log").start()
            put_s, get_s = until_working(tier, t0, f"single{n}", timeout_s)
            rows.append(Recovery("single", n + 1, put_s, get_s, read_back(tier, old),
                                 len(old)))
    finally:
        tier.bench_index.close()  # type: ignore[attr-defined]
        master.stop()
    return rows


def summary(rows: list[Recovery]) -> dict:
    """Per mode: median and max seconds to the first put and get, old blocks kept."""
    out = {}
    for mode in dict.fromkeys(r.mode for r in rows):
        mine = [r for r in rows if r.mode == mode]
        stats = {"kills": len(mine), "recovered": sum(r.get_s is not None for r in mine)}
        for what in ("put_s", "get_s"):
            seen = [getattr(r, what) for r in mine if getattr(r, what) is not None]
            stats[f"{what}_median"] = statistics.median(seen) if seen else None
            stats[f"{what}_max"] = max(seen) if seen else None
        stats["old_kept"] = f"{min(r.old_kept for r in mine)}-{max(r.old_kept for r in mine)}" \
                            f" of {mine[0].old}"
        out[mode] = stats
    return out


MEASURES = {"ha": measure_ha, "single": measure_single}


def run_child(mode: str, kills: int, root: Path, timeout_s: float) -> list[Recovery]:
    """One mode in a child process under `root`; its rows. Killed at `timeout_s`."""
    cmd = [sys.executable, "-m", "kvtier.tools.bench.failover", "--mode", mode,
           "--kills", str(kills), "--dir", str(root)]
    with open(root / f"{mode}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0 or not out.strip():
        raise KVTierError(f"the {mode} failover run failed (exit {proc.returncode}); "
                          f"see {root / f'{mode}.log'}")
    return [Recovery(**row) for row in json.loads(out.strip().splitlines()[-1])]


def run(kills: int, modes: tuple[str, ...] = ("ha", "single"), root: Path | None = None,
        timeout_s: float = 600.0) -> dict:
    """Every mode in a child process and a dir of its own; the rows and their summary."""
    rows: list[Recovery] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-failover-") as tmp:
        for mode in modes:
            where = Path(root or tmp) / mode
            where.mkdir(parents=True, exist_ok=True)
            rows += run_child(mode, kills, where, timeout_s)
    return {"rows": [asdict(r) for r in rows], "summary": summary(rows)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one mode of `kvtier bench failover`")
    parser.add_argument("--mode", choices=sorted(MEASURES), required=True)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = MEASURES[args.mode](args.dir, args.kills)
    print(json.dumps([asdict(r) for r in rows]), flush=True)
    os._exit(0)  # skip Mooncake's ~30 s client teardown (module docstring)


if __name__ == "__main__":
    main()
