"""The tier policy: one YAML file validated once into frozen, typed objects.

`load_policy(path)` reads a policy file (or, with no path, the embedded default that runs on
one machine) and returns a `Policy`. Every mistake is a `ConfigError` whose one-line message
names the file, the field path (`tiers[1].capacity`) and what was expected.

Kinds are data: `TIER_KINDS`, `EVICTION_KINDS` and `ADMISSION_KINDS` map a `kind:` string to
its config class; the implementations are looked up by the same strings in `tiers/` and
`eviction/`. Units live in attribute names (`capacity_bytes`, `timeout_s`); the YAML spells
them as sizes (`512MiB`) and rates (`2TiB/day`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationError, model_validator)

from kvtier.store.base.config_errors import format_validation_error
from kvtier.store.base.errors import ConfigError
from kvtier.store.base.policies import (ADMISSION_KINDS, EVICTION_KINDS, AdmissionConfig,
                                        EvictionConfig)
from kvtier.store.base.units import parse_rate, parse_size

Size = Annotated[int, BeforeValidator(parse_size)]


def _matching(pattern: str, expected: str):
    regex = re.compile(pattern)

    def check(value: str) -> str:
        if not regex.fullmatch(value):
            raise ValueError(f"expected {expected}, got {value!r}")
        return value

    return AfterValidator(check)


Address = Annotated[str, _matching(r"[^:\s/]+:[0-9]{1,5}", "HOST:PORT like '127.0.0.1:50051'")]
TierName = Annotated[str, _matching(r"[a-z][a-z0-9_-]{0,31}",
                                    "a lowercase name like 'dram' or 'nvme0' (a-z, 0-9, _ or -)")]
Tenant = Annotated[str, _matching(r"[A-Za-z0-9_.-]{1,64}", "letters, digits, '.', '_' or '-'")]
Rate = Annotated[float, BeforeValidator(parse_rate)]


def _file_mode(v: object) -> object:
    """`0o600`, `600` or `0600` (as `config show` prints it, or an octal string) -> int."""
    if isinstance(v, str):
        text = v.strip().lower().removeprefix("0o")
        if not text or any(ch not in "01234567" for ch in text):
            raise ValueError(f"expected an octal file mode like 0o600, got {v!r}")
        return int(text, 8)
    return v


FileMode = Annotated[int, BeforeValidator(_file_mode)]


def _endpoint_list(v: object) -> object:
    """`a:1,b:2` (as `kvtier master --etcd` takes them) or a list -> a list of endpoints."""
    if isinstance(v, str):
        return [part.strip() for part in v.split(",") if part.strip()]
    return v


Endpoints = Annotated[tuple[Address, ...], BeforeValidator(_endpoint_list)]
_FROZEN = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


def kvtier_home() -> Path:
    """The root of kvtier's default files: `$KVTIER_HOME`, else `~/.cache/kvtier`."""
    return Path(os.environ.get("KVTIER_HOME") or Path.home() / ".cache" / "kvtier").expanduser()


class NamespaceConfig(BaseModel):
    """What separates one cache from another; the runtime adds dtype, layout and ranks."""

    model_config = _FROZEN
    model: str | None = None
    tenant: Tenant = "default"


class IndexConfig(BaseModel):
    model_config = _FROZEN
    path: Path
    map_size_bytes: Size = Field(default=1 << 30, alias="map_size", gt=0)
    max_map_size_bytes: Size = Field(default=64 << 30, alias="max_map_size", gt=0)

    @model_validator(mode="after")
    def _max_not_below_start(self) -> "IndexConfig":
        if self.max_map_size_bytes < self.map_size_bytes:
            raise ValueError("max_map_size must be at least map_size")
        return self


class MasterConfig(BaseModel):
    """Where the Mooncake master answers, and the flags kvtier starts it with when embedded.

    With `etcd` set the masters run in Mooncake's HA mode: every master started with these
    endpoints campaigns in etcd, the winner leads and the others stand by; clients ask etcd
    for the leader (`client_address`), and `address` is only where `kvtier master` binds the
    master of this host. HA masters are the operator's: `embedded` defaults to false there,
    and true is an error."""

    model_config = _FROZEN
    address: Address = "127.0.0.1:50051"
    embedded: bool = True
    etcd: Endpoints = ()
    metadata_server: str = "P2PHANDSHAKE"
    start_timeout_s: float = Field(default=20.0, gt=0)
    default_kv_lease_ttl_ms: int = Field(default=10_000, gt=0)
    default_kv_soft_pin_ttl_ms: int = Field(default=30 * 60_000, gt=0)
    eviction_high_watermark_ratio: float = Field(default=0.95, gt=0, le=1)
    eviction_ratio: float = Field(default=0.05, gt=0, lt=1)
    extra_flags: dict[str, str] = Field(default_factory=dict)
    # Where an embedded master and a kvtier-started pool service keep their logs, locks and
    # the service's segment name (a policy puts it beside its index: `<index.path>.run`).
    run_dir: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _ha_masters_not_embedded_by_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("etcd") and "embedded" not in data:
            data = {**data, "embedded": False}
        return data

    @model_validator(mode="after")
    def _ha_consistent(self) -> "MasterConfig":
        if len(set(self.etcd)) != len(self.etcd):
            raise _field_error("master.etcd", "an endpoint is listed twice; list each once")
        if self.etcd and self.embedded:
            raise _field_error("master.embedded", "HA masters (master.etcd) are run by the "
                               "operator (`kvtier master --ha`), never embedded; set "
                               "master.embedded: false or drop master.etcd")
        return self

    @property
    def ha(self) -> bool:
        """True when the masters run in Mooncake's HA mode (etcd endpoints given)."""
        return bool(self.etcd)

    @property
    def client_address(self) -> str:
        """The master address a Mooncake client is given: `HOST:PORT`, or in HA mode the
        etcd endpoints it finds the leader through (`etcd://HOST:PORT;HOST:PORT`)."""
        return f"etcd://{';'.join(self.etcd)}" if self.etcd else self.address

    @property
    def runtime_dir(self) -> Path:
        """`run_dir`, or `$KVTIER_HOME` for a master config made outside a policy."""
        return self.run_dir if self.run_dir is not None else kvtier_home()

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


class MoverConfig(BaseModel):
    """The background mover: demotion, persistence, promotion and prefetch, bounded.

    `buffer`: the arena every copy goes through. `hold`: memory for copies of just-saved
    frames, kept until they are persisted when the first tier may drop them first (unset:
    as much as `buffer`; 0: never copy, persist only by reading the first tier back).
    `yield_to_prefill_s`: how long queued work may wait while the engine computes a prefill,
    and a persist also while it decodes (its copies would take CPU, and the GIL, from the
    engine's steps; 0: never wait); on a CPU cache the worker's saves to the first tier wait
    as long at most. `idle_after_s`: how long after its last step the engine
    counts as idle (its steps follow each other within milliseconds while requests run;
    an agent's next turn comes seconds later); a CPU cache's saves, which wait for the end of
    the step that gathered them, wait this long at most when nothing tells them."""

    model_config = _FROZEN
    buffer_bytes: Size = Field(default=256 << 20, alias="buffer", gt=0)
    hold_bytes: Size | None = Field(default=None, alias="hold", ge=0)
    batch_blocks: int = Field(default=32, ge=1, le=4096)
    queue_blocks: int = Field(default=65536, ge=1)
    interval_s: float = Field(default=0.2, gt=0)
    high_watermark: float = Field(default=0.9, gt=0, le=1)
    low_watermark: float = Field(default=0.8, gt=0, lt=1)
    promote_on_hit: bool = True
    yield_to_prefill_s: float = Field(default=10.0, ge=0)
    idle_after_s: float = Field(default=0.05, ge=0)

    @model_validator(mode="after")
    def _low_below_high(self) -> "MoverConfig":
        if self.low_watermark >= self.high_watermark:
            raise ValueError("low_watermark must be below high_watermark")
        return self


class MooncakeTierConfig(BaseModel):
    """The pooled DRAM tier; `capacity` is the segment this process (or, with `service`, the
    node's pool service) lends to the pool."""

    model_config = _FROZEN
    kind: Literal["mooncake"]
    name: TierName
    capacity_bytes: Size = Field(alias="capacity", gt=0)
    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = ""
    # The address other hosts reach this process's segment at. Unset: the source address of
    # this host's route to the master (loopback when the master is on loopback).
    local_hostname: str | None = None
    buffer_bytes: Size = Field(default=64 << 20, alias="buffer", gt=0)
    staging_bytes: Size = Field(default=64 << 20, alias="staging", gt=0)
    soft_pin: bool = True
    replicas: int = Field(default=1, ge=1)
    # Put into this process's own segment first (a local copy, no network); the master
    # spills to other segments when it is full. False lets the master place every object.
    prefer_local: bool = True
    retry_backoff_s: float = Field(default=0.05, ge=0)
    # A transfer that moves no byte for this long is dropped (Mooncake's TCP progress
    # timeout, `MC_TCP_PROGRESS_TIMEOUT_SEC`, set for the process unless already set): a
    # load has given up on it long before (its deadline), and until then it spins a core.
    stall_timeout_s: float = Field(default=2.0, gt=0, le=600)
    # A lookup the master has not answered in this long is a miss, and the tier is skipped
    # until the master answers a probe again (at most every second): a master across a
    # cut link would otherwise hold the lookup for Mooncake's RPC timeout (~30 s).
    call_timeout_s: float = Field(default=1.0, gt=0, le=600)
    # The node's pool service (Mooncake's standalone `mooncake_client`) at this address:
    # set, this process lends nothing and moves frames through shared memory with the
    # service, which holds the node's segment of `capacity` bytes (the fast path when
    # several engines share a node: no TCP between them). Unset: this process lends
    # `capacity` itself and reaches other processes' segments over `protocol`.
    service: Address | None = None
    service_embedded: bool = True  # start the service when none answers at `service`
    service_threads: int = Field(default=2, ge=1, le=64)
    # Lend the segment from a file in this directory (a tmpfs: /dev/shm) instead of private
    # memory: the other kvtier processes of the node then copy its blocks straight out of
    # the file, with no transfer (`tiers.mooncake.segments`). Embedded clients only.
    segment_dir: str | None = None
    # With `segment_dir`: a CPU engine scatters the blocks it loads straight out of a
    # lender's file and checks what landed in its cache after (README, "Segments in
    # files"); false copies each frame and checks the copy first (~5 ms more per 16K hit).
    read_in_place: bool = True
    # Count the pool hits whose lender is on another host (`cross_host_hits`, in `inspect`):
    # one more master query per load, for measurements (`kvtier replay --hosts`).
    count_lender_hosts: bool = False
    eviction: EvictionConfig | None = None

    @model_validator(mode="after")
    def _segment_big_enough(self) -> "MooncakeTierConfig":
        if self.capacity_bytes < 16 << 20:  # Mooncake refuses smaller segments (-600)
            raise ValueError("capacity must be at least 16MiB (Mooncake's smallest segment)")
        if self.segment_dir is not None and self.service is not None:
            raise ValueError("segment_dir and service exclude each other: the service lends "
                             "the node's segment; drop one of them")
        return self


class IOConfig(BaseModel):
    model_config = _FROZEN
    engine: Literal["uring", "psync"] = "uring"
    queue_depth: int = Field(default=32, ge=1, le=4096)
    direct: bool = True


class NvmeTierConfig(BaseModel):
    """A node-local log-structured store of region files on a fast disk."""

    model_config = _FROZEN
    kind: Literal["nvme"]
    name: TierName
    path: Path
    capacity_bytes: Size = Field(alias="capacity", gt=0)
    region_bytes: Size = Field(default=64 << 20, alias="region_size", gt=0)
    io: IOConfig = IOConfig()
    eviction: EvictionConfig | None = None

    @model_validator(mode="after")
    def _regions_fit(self) -> "NvmeTierConfig":
        if self.region_bytes % 4096:
            raise ValueError("region_size must be a multiple of 4KiB")
        if self.capacity_bytes < 2 * self.region_bytes:
            raise ValueError("capacity must hold at least two regions (see region_size)")
        return self


class SharedFSTierConfig(BaseModel):
    """One file per block on a filesystem every node mounts."""

    model_config = _FROZEN
    kind: Literal["sharedfs"]
    name: TierName
    path: Path
    capacity_bytes: Size = Field(alias="capacity", gt=0)
    fsync: bool = True
    file_mode: FileMode = Field(default=0o600, ge=0, le=0o777)
    stale_temp_after_s: float = Field(default=3600.0, gt=0)
    # How long a lookup waits for the filesystem (a stat on a hard-mounted network
    # filesystem whose server is gone blocks until it returns): past it the tier is skipped
    # until that stat answers.
    call_timeout_s: float = Field(default=1.0, gt=0, le=600)
    eviction: EvictionConfig | None = None


TIER_KINDS: dict[str, type[BaseModel]] = {
    "mooncake": MooncakeTierConfig,
    "nvme": NvmeTierConfig,
    "sharedfs": SharedFSTierConfig,
}
# Fastest first: a policy lists its tiers in this order.
TIER_RANK = {"mooncake": 0, "nvme": 1, "sharedfs": 2}
TierConfig = Annotated[Union[tuple(TIER_KINDS.values())], Field(discriminator="kind")]


class Policy(BaseModel):
    """A validated tier policy. Build it with `load_policy`, never by hand in production."""

    model_config = _FROZEN
    namespace: NamespaceConfig = NamespaceConfig()
    chunk_tokens: int = Field(default=256, ge=1, le=65536)
    index: IndexConfig
    master: MasterConfig = MasterConfig()
    mover: MoverConfig = MoverConfig()
    tiers: list[TierConfig] = Field(min_length=1)
    eviction: EvictionConfig = Field(default_factory=lambda: EVICTION_KINDS["lru"](kind="lru"))
    admission: AdmissionConfig = Field(
        default_factory=lambda: ADMISSION_KINDS["reuse"](kind="reuse"))
    source: str = Field(default="<default policy>", exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _admission_kind_defaults_to_reuse(cls, data: Any) -> Any:
        admission = data.get("admission") if isinstance(data, dict) else None
        if isinstance(admission, dict) and "kind" not in admission:
            data = {**data, "admission": {"kind": "reuse", **admission}}
        return data

    @model_validator(mode="after")
    def _tiers_consistent(self) -> "Policy":
        names: set[str] = set()
        paths: dict[Path, str] = {}
        last_rank = -1
        for i, tier in enumerate(self.tiers):
            if tier.name in names:
                raise _field_error(f"tiers[{i}].name", f"duplicate tier name {tier.name!r}; "
                                   "give each tier its own name")
            names.add(tier.name)
            rank = TIER_RANK[tier.kind]
            if rank < last_rank:
                raise _field_error(f"tiers[{i}].kind", f"tiers must go fastest first "
                                   f"(mooncake, nvme, sharedfs); {tier.kind!r} comes too late")
            if rank == 0 and last_rank == 0:
                raise _field_error(f"tiers[{i}].kind",
                                   "only one mooncake tier is allowed; remove the others")
            last_rank = rank
            path = getattr(tier, "path", None)
            if path is not None:
                if path in paths:
                    raise _field_error(f"tiers[{i}].path",
                                       f"same path as tier {paths[path]!r}; give each tier its own")
                paths[path] = tier.name
        if self.mover.high_watermark >= self.master.eviction_high_watermark_ratio:
            # kvtier must demote on its own policy before the master's lease-ordered
            # eviction starts dropping blocks of live sessions.
            raise _field_error("mover.high_watermark",
                               f"must be below master.eviction_high_watermark_ratio "
                               f"({self.master.eviction_high_watermark_ratio}) so kvtier demotes "
                               "before the master evicts")
        return self

    def tier(self, name: str) -> BaseModel:
        """The tier config called `name`; KeyError names the known tiers."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier {name!r}; known: {', '.join(t.name for t in self.tiers)}")

    def to_dict(self) -> dict[str, Any]:
        """The resolved policy as plain data under the attribute names (sizes in bytes,
        paths as strings); `config_dump.policy_as_written` gives the file's keys."""
        return self.model_dump(mode="json", by_alias=False)


class _FieldError(ValueError):
    """A cross-field check that knows the exact path to blame."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


def _field_error(path: str, message: str) -> _FieldError:
    return _FieldError(path, message)


def default_policy_dict(home: Path | None = None) -> dict[str, Any]:
    """The policy used with no file: one machine, embedded master, three small tiers."""
    home = home or kvtier_home()
    return {
        "chunk_tokens": 256,
        "index": {"path": str(home / "index"), "map_size": "1GiB"},
        "master": {"address": "127.0.0.1:50051", "embedded": True},
        "tiers": [
            {"name": "dram", "kind": "mooncake", "capacity": "1GiB", "protocol": "tcp"},
            {"name": "nvme", "kind": "nvme", "path": str(home / "nvme"), "capacity": "16GiB"},
            {"name": "shared", "kind": "sharedfs", "path": str(home / "shared"),
             "capacity": "64GiB"},
        ],
    }


def load_policy(path: str | os.PathLike[str] | None = None) -> Policy:
    """Read and validate a policy file; with `path=None`, the embedded default."""
    if path is None:
        return policy_from_dict(default_policy_dict(), source="<default policy>")
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such policy file; check the path or omit it to use "
                          "the default policy") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the policy file ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of policy fields at the top level, "
                          f"got {type(data).__name__}")
    return policy_from_dict(data, source=str(path), base_dir=path.parent)


def policy_from_dict(data: dict[str, Any], source: str = "<inline policy>",
                     base_dir: Path | None = None) -> Policy:
    """Validate a policy given as a mapping (inline connector config, tests)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of policy fields, got "
                          f"{type(data).__name__}")
    data = dict(data)
    index = data.get("index")
    if index is None or isinstance(index, dict) and "path" not in index:
        # The default applies to a section that sets only sizes as to no section at all.
        data["index"] = {**(index or {}), "path": str(kvtier_home() / "index")}
    try:
        data = _resolve_paths(data, base_dir)
        data = _run_dir_beside_index(data)
        policy = Policy.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, Policy)) from None
    except _FieldError as e:
        raise ConfigError(f"{source}: {e.path}: {e}") from None
    return policy.model_copy(update={"source": source})


def _run_dir_beside_index(data: dict[str, Any]) -> dict[str, Any]:
    """Runtime files of the policy's master and pool service go beside its index, so a
    policy whose paths share one directory keeps every file kvtier writes there."""
    master = data.get("master") if isinstance(data.get("master"), dict) else {}
    index = data.get("index")
    if master.get("run_dir") or not (isinstance(index, dict) and index.get("path")):
        return data
    return {**data, "master": {**master, "run_dir": f"{index['path'].rstrip('/')}.run"}}


def _resolve_paths(data: dict[str, Any], base_dir: Path | None) -> dict[str, Any]:
    """Expand `~` and `$VARS`, make relative paths relative to the policy file (to the
    working directory for an inline policy), and absolute."""

    def fix(p: object) -> object:
        if not isinstance(p, str) or not p:
            return p
        out = Path(os.path.expandvars(os.path.expanduser(p)))
        if not out.is_absolute() and base_dir is not None:
            out = base_dir / out
        return os.path.abspath(out)

    index = data.get("index")
    if isinstance(index, dict) and "path" in index:
        data["index"] = {**index, "path": fix(index["path"])}
    master = data.get("master")
    if isinstance(master, dict) and master.get("run_dir"):
        data["master"] = {**master, "run_dir": fix(master["run_dir"])}
    tiers = data.get("tiers")
    if isinstance(tiers, list):
        data["tiers"] = [{**t, **{k: fix(t[k]) for k in ("path", "segment_dir") if k in t}}
                         if isinstance(t, dict) else t for t in tiers]
    return data
