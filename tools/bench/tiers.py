"""`kvtier bench tiers`: each tier's put and get beside the limit of what it is built on.

For every tier of a policy (default: an embedded master on a free port and tier directories
under `--dir`) and every case (block size x batch size), the bench times `put` then `get` of
one batch of sealed frames, round after round, deleting the batch after each round. In the
same run it measures the references: raw `mooncake.store` batch calls with registered buffers
(interleaved round by round with the mooncake tier, so load from elsewhere hits both alike)
and fio (io_uring, O_DIRECT) on each file tier's filesystem at the same block size and queue
depth (1 for a batch of 1, else the nvme queue depth), and the frame checksum alone, in one
thread and on every core (`tools.bench.checksum`). The mooncake tier runs twice: from
registered buffers (zero-copy) and through its staging buffer; nvme runs with both engines.
With the default policy the pool tier is measured a second time as `dram-files`, lent from
a segment file in /dev/shm as the README sets it up (a block of the node is copied out of
its lender's file, not moved by Mooncake's transfer), beside a raw client that lends from a
file too; it is left out, and the reason said, where /dev/shm or memory cannot hold both
files.

Every case moves about `op_bytes` per op (within [min_iters, max_iters] calls); a batch never
holds more than `max_batch_bytes` (a 16 MiB x 64 batch is 1 GiB). The tiers are opened through
`open_tier`, so the bench measures whatever the policy builds.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvtier.store.base.block import frame_size
from kvtier.store.base.config import MasterConfig, Policy, load_policy, policy_from_dict
from kvtier.store.base.errors import ConfigError
from kvtier.store.base.index import Index
from kvtier.tiers.base import TierContext
from kvtier.tiers.mooncake.master import EmbeddedMaster, ensure_master, free_port
from kvtier.tiers.registry import open_tier
from kvtier.tools.bench import fio as bench_fio
from kvtier.tools.bench import report as bench_report
from kvtier.tools.bench.checksum import checksum_rows, hash_rows
from kvtier.tools.bench.report import Row, row_from_times
from kvtier.tools.bench.targets import SLOT_ALIGN, RawTarget, TierTarget, Workload

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class BenchSpec:
    sizes: tuple[int, ...] = (256 * KiB, 2 * MiB, 16 * MiB)
    batches: tuple[int, ...] = (1, 64)
    op_bytes: int = 1 * GiB
    max_batch_bytes: int = 1 * GiB
    min_iters: int = 3
    max_iters: int = 200
    warmup: int = 1
    fio: bool = True

    def iters(self, batch_bytes: int) -> int:
        return max(self.min_iters, min(self.max_iters, self.op_bytes // batch_bytes))

    def batch_of(self, block: int, batch: int) -> int:
        return max(1, min(batch, self.max_batch_bytes // block))


FULL = BenchSpec()
QUICK = BenchSpec(op_bytes=64 * MiB, max_batch_bytes=128 * MiB, min_iters=2, max_iters=30)


FILES_TIER = "dram-files"  # the pool lent from segment files, as in the README's setup
SHM = Path("/dev/shm")


def pool_mib(spec: BenchSpec) -> int:
    """What each pool client of the bench lends: one batch and some."""
    return -(-int(spec.max_batch_bytes * 1.25 + 64 * MiB) // MiB)


def bench_policy(root: Path, spec: BenchSpec, master_address: str) -> Policy:
    """Tiers sized for the bench: the pool holds one batch, the disks a few."""
    pool = pool_mib(spec)
    disk = max(4 * GiB, 4 * spec.max_batch_bytes)
    return policy_from_dict({
        "index": {"path": str(root / "index"), "map_size": "256MiB"},
        "master": {"address": master_address, "embedded": True},
        "tiers": [
            {"name": "dram", "kind": "mooncake", "capacity": f"{pool}MiB", "staging": "64MiB"},
            {"name": "nvme", "kind": "nvme", "path": str(root / "nvme"), "capacity": disk,
             "region_size": "64MiB", "io": {"engine": "uring", "queue_depth": 32}},
            {"name": "shared", "kind": "sharedfs", "path": str(root / "shared"),
             "capacity": disk},
        ]}, source="<bench policy>")


def segment_dir_for(spec: BenchSpec, shm: Path = SHM) -> tuple[Path | None, str]:
    """A fresh directory in /dev/shm for the files tier and its raw client, or None and why
    not (each lends a file of `pool_mib`, allocated in full)."""
    need = 2 * pool_mib(spec) * MiB
    try:
        st = os.statvfs(shm)
    except OSError as e:
        return None, f"{shm} is not usable ({e.strerror})"
    free = st.f_bavail * st.f_frsize
    if free < need:
        return None, (f"{shm} has {free // MiB} MiB free and its two segment files need "
                      f"{need // MiB} MiB (--quick needs less; Docker: --shm-size)")
    avail = _mem_available()
    if avail is not None and avail < 2 * need:  # the files, and the private pool's as much
        return None, (f"{avail // MiB} MiB of memory available, and its two segment files "
                      f"need {need // MiB} MiB beside the private pool's (--quick needs less)")
    try:
        return Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=shm)), ""
    except OSError as e:
        return None, f"cannot make a directory in {shm} ({e.strerror})"


def _mem_available() -> int | None:
    """The kernel's estimate of the memory a new workload can take, in bytes (None: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def measure_group(targets: list, work: Workload, spec: BenchSpec, console: Console) -> list[Row]:
    """All cases for targets measured side by side, interleaved round by round."""
    rows = []
    big = max(spec.sizes)
    for t in targets:
        t.prefault(work, big, min(spec.batch_of(big, max(spec.batches)), max(1, 64 * MiB // big)))
    order = random.Random(0)
    for block in spec.sizes:
        for want in spec.batches:
            batch = spec.batch_of(block, want)
            iters = spec.iters(block * batch)
            names = ", ".join(t.label for t in targets)
            console.log(escape(f"{names}: {_size(block)} x{batch}, {iters} rounds"))
            keys, frames, outs = work.case(block, batch)
            times = {t.label: ([], []) for t in targets}
            for r in range(spec.warmup + iters):
                for t in order.sample(targets, len(targets)):  # no target always goes first
                    put_s, get_s = t.round(keys, frames, outs)
                    if r >= spec.warmup:
                        times[t.label][0].append(put_s)
                        times[t.label][1].append(get_s)
            for t in targets:
                for op, ts in zip(("put", "get"), times[t.label]):
                    extra = {**t.extra, "ref_batch": _fio_qd(t, batch)}
                    rows.append(row_from_times(t.label, t.kind, op, block, batch, ts,
                                               reference=t.reference, extra=extra))
    return rows


def _fio_qd(target, batch: int) -> int:
    """The fio queue depth a file tier's batch compares with (its own depth, at most)."""
    if target.reference != "fio":
        return batch
    return 1 if batch == 1 else min(batch, target.extra.get("queue_depth", 32))


def fio_rows(directory: Path, rows: list[Row], spec: BenchSpec, console: Console,
             done: dict) -> list[Row]:
    """fio at every (block, queue depth) the file-tier rows compare with, once per filesystem."""
    out = []
    directory.mkdir(parents=True, exist_ok=True)
    dev = os.stat(directory).st_dev
    for block, qd in sorted({(r.block_bytes, r.extra["ref_batch"]) for r in rows
                             if r.reference == "fio"}):
        size = min(max(spec.op_bytes, block * qd * 8), 2 * GiB)
        for rw in ("write", "read"):
            if (dev, rw, block, qd) not in done:
                console.log(f"fio {rw} bs={_size(block)} iodepth={qd} in {directory}")
                res = bench_fio.run_fio(directory, rw, block, qd, size)
                done[(dev, rw, block, qd)] = Row("fio", "reference", rw, block, qd, res.gbps,
                                                 res.p50_ms, res.p99_ms, extra=asdict(res))
            out.append(done[(dev, rw, block, qd)])
    bench_fio.remove_fio_file(directory)
    return out


def _size(n: int) -> str:
    return f"{n // MiB}MiB" if n % MiB == 0 else f"{n // KiB}KiB"


def _pool_group(cfg, ctx: TierContext, work: Workload, opened: list, ref: str) -> list:
    """A pool tier from registered buffers and through staging, beside a raw client of the
    same config, bare and with each frame checked."""
    from kvtier.tiers.mooncake.raw_bench import RawMooncake
    tier = open_tier(cfg, ctx)
    opened.append(tier)
    tier.register(work.src)  # zero-copy rounds use these; staging rounds ignore it
    tier.register(work.dst)
    raw = RawMooncake(cfg, ctx.master)
    opened.append(raw)
    return [TierTarget(f"{cfg.name}[zero-copy]", tier, ref, zero_copy=True),
            TierTarget(f"{cfg.name}[staging]", tier, ref, zero_copy=False),
            RawTarget(raw, work, label=ref), RawTarget(raw, work, verify=True, label=ref)]


def _tier_targets(policy: Policy, ctx: TierContext, only: set[str] | None, work: Workload,
                  console: Console, segment_dir: Path | None = None) -> tuple[list[list], list]:
    """Open every tier (and its variants); group what is measured side by side. With
    `segment_dir` (given where `only` asks for it), the pool tier is also measured lent from
    files there (`FILES_TIER`)."""
    groups, opened = [], []
    for cfg in policy.tiers:
        try:
            if cfg.kind == "mooncake":
                if not only or cfg.name in only or cfg.kind in only:
                    groups.append(_pool_group(cfg, ctx, work, opened, "raw mooncake"))
                if segment_dir is not None:
                    files = cfg.model_copy(update={"name": FILES_TIER,
                                                   "segment_dir": str(segment_dir)})
                    groups.append(_pool_group(files, ctx, work, opened,
                                              f"raw mooncake [{FILES_TIER}]"))
                continue
            if only and cfg.name not in only and cfg.kind not in only:
                continue
            if cfg.kind == "nvme":
                group = []
                for engine in ("uring", "psync"):
                    c = cfg.model_copy(update={
                        "name": f"{cfg.name}-{engine}", "path": cfg.path / engine,
                        "io": cfg.io.model_copy(update={"engine": engine})})
                    c.path.mkdir(parents=True, exist_ok=True)  # bench data of one engine
                    tier = open_tier(c, ctx)
                    opened.append(tier)
                    group.append(TierTarget(f"{cfg.name}[{engine}]", tier, "fio", engine=engine,
                                            queue_depth=cfg.io.queue_depth, path=str(c.path)))
                groups.append(group)
            else:
                cfg.path.mkdir(parents=True, exist_ok=True)
                tier = open_tier(cfg, ctx)
                opened.append(tier)
                groups.append([TierTarget(cfg.name, tier, "fio", path=str(cfg.path))])
        except ModuleNotFoundError as e:
            console.log(f"[yellow]skipping tier {cfg.name!r}: {e.name} is not built yet[/]")
    return groups, opened


def _check_only(only: set[str] | None, policy: Policy, files: bool) -> None:
    """Refuse names in `--tiers` that measure nothing (a typo would print an empty table)."""
    known = {"verify"} | {t.name for t in policy.tiers} | {t.kind for t in policy.tiers}
    if files and any(t.kind == "mooncake" for t in policy.tiers):
        known.add(FILES_TIER)
    unknown = sorted((only or set()) - known)
    if unknown:
        raise ConfigError(f"--tiers: no tier or kind named {', '.join(map(repr, unknown))} "
                          f"here; choose from {', '.join(sorted(known))}")


def run_bench(spec: BenchSpec, policy_path: Path | None = None, root: Path | None = None,
              only: set[str] | None = None, repeat: int = 1,
              console: Console | None = None) -> tuple[list[Row], list[Row], list[dict]]:
    """Measure every tier and reference `repeat` times; return (rows, references, targets)."""
    console = console or Console(stderr=True)
    made = root is None  # a temp dir of ours: removed after a clean run, kept after an error
    root = Path(root) if root else Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    master = shm = index = None
    opened: list = []
    done = False
    try:
        if policy_path is not None:
            policy = load_policy(policy_path)
            _check_only(only, policy, files=False)
            if any(t.kind == "mooncake" for t in policy.tiers):
                master = ensure_master(policy.master)
        else:
            policy = bench_policy(root, spec, f"127.0.0.1:{free_port()}")
            _check_only(only, policy, files=True)
            cfg = MasterConfig(address=policy.master.address, embedded=True)
            master = EmbeddedMaster(cfg, log_path=root / "master.log").start()
            if only is None or FILES_TIER in only or "mooncake" in only:
                shm, why = segment_dir_for(spec)
                if shm is None:
                    console.log(f"[yellow]skipping tier {FILES_TIER!r} (the README's setup): "
                                f"{escape(why)}[/]")
        index = Index(policy.index.path, policy.index.map_size_bytes,
                      policy.index.max_map_size_bytes)
        ctx = TierContext(index, "bench", policy.master)
        work = Workload(max(spec.batch_of(b, n) * frame_size(b, SLOT_ALIGN)
                            for b in spec.sizes for n in spec.batches))
        groups, opened = _tier_targets(policy, ctx, only, work, console, shm)
        runs = []
        for _ in range(repeat):
            got, fio_done = [], {}
            for group in groups:
                rows = measure_group(group, work, spec, console)
                got += rows
                if spec.fio and group[0].reference == "fio":
                    fio_dir = Path(group[0].extra["path"]).parent / ".kvtier-fio"
                    got += fio_rows(fio_dir, rows, spec, console, fio_done)
            if only is None or "verify" in only:
                got += checksum_rows(spec.sizes, spec.max_batch_bytes)
                hashes, skipped = hash_rows(spec.sizes, spec.max_batch_bytes)
                got += hashes
                if not runs:  # once, not every repeat
                    for line in skipped:
                        console.log(f"[yellow]hash candidate skipped: {line}[/]")
            runs.append(got)
        done = True
    finally:
        for thing in reversed(opened):
            thing.close()
        if index is not None:
            index.close()
        if master is not None:
            master.stop()
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)  # the lenders removed their files at close
        if made and (done or master is None):
            shutil.rmtree(root, ignore_errors=True)
        elif made:
            console.log(f"kept {root} (its master.log) for the error")
    merged = bench_report.merge_runs(runs)
    rows = [r for r in merged if r.kind != "reference"]
    refs = [r for r in merged if r.kind == "reference"]
    bench_report.link_references(rows, refs)
    return rows, refs, bench_report.check_targets(rows)


def spec_dict(spec: BenchSpec) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(spec).items()}


def with_options(spec: BenchSpec, sizes: list[int] | None, batches: list[int] | None,
                 fio: bool) -> BenchSpec:
    return replace(spec, sizes=tuple(sizes or spec.sizes), batches=tuple(batches or spec.batches),
                   fio=fio)
