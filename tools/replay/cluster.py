"""The clusters a replay runs against: one per configuration, fresh, torn down after it.

A configuration (`Config`) is what the comparison varies:
- `kvtier`: every instance with the kvtier connector on the full stack: the DRAM pool (each
  instance lends `dram_bytes / N` to it), an nvme dir per instance, one shared dir;
- `dram-only`: the same pool, no nvme and no sharedfs (what a DRAM-only pool does when it
  is small);
- `local`: no connector: each instance has only vLLM's own prefix cache;
- `mooncake-store`: a peer, vLLM's own `MooncakeStoreConnector` as its users run it
  (standalone-store mode: one `mooncake_client` lending a pool of the same size as kvtier's,
  over TCP on loopback; `tools.bench.peer_systems`);
- `mooncake-store+ssd`: the same with Mooncake's own SSD offload under the pool (its
  `mooncake_client` writes every object to a disk of kvtier's disk tiers' size and reads
  back from there what the pool dropped);
- `lmcache`: a peer, `LMCacheMPConnector` and one `lmcache server` whose L1 is the pool's
  size, the engines as vLLM multi-process engines from the peers' venv (`make peers`;
  `tools.bench.lmcache_peer`).
Every cluster starts empty (its own master and directories), so configurations never see each
other's blocks. Both engine kinds use the same node policies (`node_policy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.store.base.block import HEADER_SIZE
from kvtier.store.base.errors import KVTierError

# other systems' connectors, run as their users would
PEERS = ("mooncake-store", "mooncake-store+ssd", "lmcache")
KINDS = ("kvtier", "dram-only", "local", *PEERS)
MIN_SEGMENT = 16 << 20  # Mooncake's smallest segment
POOLS = ("auto", "files", "service", "embedded")  # how real engines share the pool (`--pool`)
MODEL_NAME = "tiny-llama"


class ReplayError(KVTierError):
    """A replay cannot run as asked; the message names the option to change."""


@dataclass(frozen=True)
class Config:
    kind: str                     # one of KINDS
    dram_frac: float | None       # pool size as a fraction of the working set
    label: str

    @property
    def uses_store(self) -> bool:
        """Whether the instances run the kvtier connector."""
        return self.kind in ("kvtier", "dram-only")

    @property
    def pooled(self) -> bool:
        """Whether the configuration has a DRAM pool (kvtier's or a peer's) to size."""
        return self.kind != "local"


def configs(dram_fracs: tuple[float, ...], baselines: tuple[str, ...]) -> list[Config]:
    """kvtier at each DRAM size, the DRAM-only pool at each size below the working set (one
    that holds it all hits as kvtier does; with a single size it runs anyway, as the
    comparison asked for), each peer asked for at every size, then local-only once."""
    many = len(dram_fracs) > 1

    def at(kind: str, f: float) -> Config:
        return Config(kind, f, kind + (f"@{100 * f:g}%" if many else ""))

    out = [at("kvtier", f) for f in dram_fracs]
    if "dram-only" in baselines:
        out += [at("dram-only", f) for f in dram_fracs if f < 1 or not many]
    for peer in PEERS:
        if peer in baselines:
            out += [at(peer, f) for f in dram_fracs]
    if "local" in baselines:
        out.append(Config("local", None, "local"))
    return out


@dataclass(frozen=True)
class Sizing:
    """Bytes of the stored blocks and of each tier, per instance."""

    block_bytes: int              # payload of one chunk
    working_set_bytes: int        # every distinct block of the plan, as frames
    instances: int

    def segment_bytes(self, frac: float) -> int:
        """The DRAM each instance lends to the pool for a pool of `frac` x working set.
        A pool meant to hold everything (`frac >= 1`) is raised to Mooncake's smallest
        segment when it would fall below; a smaller one cannot be, and is an error."""
        seg = int(frac * self.working_set_bytes / self.instances)
        if seg < MIN_SEGMENT and frac >= 1:
            return MIN_SEGMENT
        if seg < MIN_SEGMENT:
            need = MIN_SEGMENT * self.instances / max(frac * self.working_set_bytes, 1)
            raise ReplayError(
                f"a DRAM pool of {100 * frac:g}% of the working set (which is "
                f"{self.working_set_bytes / 2**20:.0f} MiB) gives each of {self.instances} "
                f"instances {seg / 2**20:.1f} MiB, below Mooncake's 16 MiB segment; raise "
                f"--sessions, --turns, --scale or --dtype float32 (a working set "
                f"{need:.2f}x this one), or use fewer instances")
        return seg

    def disk_bytes(self) -> int:
        """What a disk tier holds (kvtier's nvme and shared dir, a peer's SSD tier): twice
        the working set, so a disk never evicts and the pool's size is what is compared."""
        return max(64 << 20, 2 * self.working_set_bytes)


def node_policy(root: Path, node: str, master: str, cfg: Config, sizing: Sizing,
                chunk_tokens: int, eviction: str, admission: str,
                tiers_root: Path | None = None, service: str | None = None,
                count_hosts: bool = False, etcd: str | None = None,
                shared: Path | None = None, run_dir: Path | None = None,
                metrics_port: int | None = None, segment_dir: Path | None = None) -> dict:
    """The inline policy of one instance (`node`) of configuration `cfg`; its index lives
    under `root`, its nvme dir and the shared dir under `tiers_root` (default `root`; the
    shared dir at `shared` where given: its host's mount of a network filesystem).
    `service`: the instances join the pool service there (one segment holding the whole
    pool, shared memory), instead of each lending its share; `run_dir` is then the one the
    service's starter used, where it names its segment for the node's processes.
    `metrics_port`: the master's, where the pool tier reads what its segment holds.
    `segment_dir`: each instance lends its share from a file there, which the node's other
    instances copy straight out of (a tmpfs; not with `service`)."""
    disk = tiers_root or root
    dram = {"name": "dram", "kind": "mooncake",
            "capacity": sizing.segment_bytes(cfg.dram_frac), "buffer": "32MiB",
            "staging": "32MiB"}
    if count_hosts:
        dram["count_lender_hosts"] = True
    if service:
        dram |= {"capacity": dram["capacity"] * sizing.instances, "service": service,
                 "service_embedded": False}
    elif segment_dir is not None:
        dram["segment_dir"] = str(segment_dir)
    tiers = [dram]
    if cfg.kind == "kvtier":
        tiers += [{"name": "nvme", "kind": "nvme", "path": str(disk / node / "nvme"),
                   "capacity": _round_up(sizing.disk_bytes(), 4 << 20),
                   "region_size": "4MiB"},
                  {"name": "shared", "kind": "sharedfs",
                   "path": str(shared or disk / "shared"),
                   "capacity": sizing.disk_bytes()}]
    return {"namespace": {"model": MODEL_NAME}, "chunk_tokens": chunk_tokens,
            "index": {"path": str(root / node / "index"), "map_size": "64MiB"},
            "master": {"address": master, "embedded": False,
                       **({"etcd": [etcd]} if etcd else {}),
                       **({"run_dir": str(run_dir)} if run_dir else {}),
                       **({"extra_flags": {"metrics_port": str(metrics_port)}}
                          if metrics_port else {})},
            "eviction": {"kind": eviction}, "admission": {"kind": admission},
            "tiers": tiers}


def pool_split(dram_counters: list[dict]) -> dict[str, int]:
    """Pool blocks loaded from a lender on the loader's own host and on another host, from
    the pool tier's counters of every node (`count_hosts` on)."""
    hits = sum(c.get("hits", 0) for c in dram_counters)
    cross = sum(c.get("cross_host_hits", 0) for c in dram_counters)
    return {"same": hits - cross, "cross": cross}


def frame_bytes(payload: int) -> int:
    return HEADER_SIZE + payload


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
