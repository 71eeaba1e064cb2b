"""The measurement behind `kvtier bench gather`: the worker's paged-KV save and load paths against the copy ceiling.

Builds a vLLM-like paged KV cache on the device (default: 32 layers, 16-token blocks, 8 KV
heads x 128, bf16, as one shared backing buffer in vLLM 0.32's per-layer [B, H, N, C] views),
then times, for `--blocks` scattered blocks moved in `--chunk-tokens` chunks:

- save: `PagedKV.gather` into device staging frames + one bulk copy into pinned host frames;
- load: one bulk copy of pinned frames to the device + `PagedKV.scatter` into the cache;
- ceiling: a plain bulk copy of the same bytes between a device buffer and pinned memory;
- per-block: the naive loop (one `copy_` per block and layer), for contrast.

and checks that a save followed by a load into other blocks restores every byte. On the CPU it
also times the check after an in-place load three ways (`check_seconds`). Reports
GB/s of payload and the ratio to the ceiling (target: >= 85%). With `--io-thread` it also
runs the connector's I/O thread end to end on the device (`stage_save` on the compute
stream, sealing and the event wait in the thread, loads on its side stream) against an
in-memory stand-in for the store (the tiers are not on a bare GPU box), and checks the bytes.
Needs only torch, numpy and xxhash (no vLLM), so it runs on a bare GPU machine with the repo
on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvtier.connector.io_thread import IOThread, LoadBatch, SaveBatch, stage_save
from kvtier.connector.layout import PagedKV
from kvtier.connector.staging import FrameBuffer, StagingPool
from kvtier.store.base import block

LAYOUTS = {  # physical order of one layer's block: head-major or token-major
    "LBHNC": lambda raw, b, h, n, c: raw.view(b, h, n, c),
    "LBNHC": lambda raw, b, h, n, c: raw.view(b, n, h, c).permute(0, 2, 1, 3),
}


def paged_cache(args, device) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views over one buffer, layer-outermost (vLLM's default)."""
    page = args.heads * args.block_size * 2 * args.head_size
    raw = torch.randn(args.layers * args.cache_blocks * page, device=device).to(torch.bfloat16)
    make = LAYOUTS[args.layout]
    per_layer = args.cache_blocks * page
    return {f"layers.{i}": make(raw[i * per_layer:(i + 1) * per_layer], args.cache_blocks,
                                args.heads, args.block_size, 2 * args.head_size)
            for i in range(args.layers)}


def timed(fn, device, reps: int) -> float:
    """Median seconds of `fn` over `reps` runs after two warm-ups."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_block_seconds(paged: PagedKV, ids: torch.Tensor, device, reps: int) -> float:
    """The naive save: one `copy_` per block and layer into pinned memory."""
    flat = ids.flatten().tolist()
    out = torch.empty(len(flat), paged.info.num_layers, paged.info.page_bytes // 2,
                      dtype=torch.bfloat16, pin_memory=device.type == "cuda")

    def per_block():
        for i, b in enumerate(flat):
            for layer, v in enumerate(paged.views):
                out[i, layer].copy_(v[b].reshape(-1), non_blocking=True)
    return timed(per_block, device, max(1, reps // 5))


def run(args) -> dict:
    device = torch.device(args.device)
    caches = paged_cache(args, device)
    paged = PagedKV(caches, args.cache_blocks, args.block_size)
    m = args.chunk_tokens // args.block_size
    n = args.blocks // m
    payload = m * paged.info.block_bytes
    stride = block.frame_size(payload, block.PAGE)
    buf = FrameBuffer(n, stride, device)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(args.cache_blocks, generator=g)
    src_ids = perm[: n * m].view(n, m).to(device)
    dst_ids = perm[n * m: 2 * n * m].view(n, m).to(device)
    view = paged.payload_view(buf.device_view, n, stride, block.HEADER_SIZE, m)

    def save():
        paged.gather(src_ids, view)
        buf.to_host(n)

    def load():
        buf.to_device(n)
        paged.scatter(dst_ids, view)

    save()
    load()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ok = all(torch.equal(v[dst_ids.flatten()], v[src_ids.flatten()]) for v in paged.views)

    secs = {"save": timed(save, device, args.reps), "load": timed(load, device, args.reps),
            **ceiling_seconds(buf, device, args.reps)}
    if args.per_block:
        secs["per_block_d2h"] = per_block_seconds(paged, src_ids, device, args.reps)
    checks = {}
    if device.type == "cpu":
        checks = check_seconds(paged, buf, dst_ids.tolist(), payload, args.reps)
        secs.update(checks)
    gbps = {k: round(n * payload / s / 1e9, 2) for k, s in secs.items()}
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "layout": args.layout, "fused": paged.info.fused, "blocks": n * m, "chunks": n,
            "payload_bytes": n * payload, "round_trip_ok": ok, "GB/s": gbps,
            "save_vs_ceiling": round(gbps["save"] / gbps["ceiling_d2h"], 3),
            "load_vs_ceiling": round(gbps["load"] / gbps["ceiling_h2d"], 3),
            **({"check_ms": {k: round(v * 1e3, 2) for k, v in checks.items()}} if checks
               else {})}


def check_seconds(paged: PagedKV, buf: FrameBuffer, rows: list[list[int]], payload: int,
                  reps: int) -> dict[str, float]:
    """The check after an in-place load (CPU), three ways, over the frames in `buf` (sealed
    here) and the blocks `rows` they were scattered to: `check_frame` checksums each frame
    where it lies (the check before 2026-12-01, blind to a frame replaced and put back
    while read); `check_cache` checksums the blocks where they lie in the cache and checks
    the sums against the headers (`PagedKV.checksums`, what the connector does when pages
    are contiguous); `check_copy` gathers them into staging first (other layouts). Each
    must pass every chunk."""
    n, size = len(rows), block.HEADER_SIZE + payload
    keys = [f"{i:048x}" for i in range(n)]
    for i, key in enumerate(keys):
        block.seal(buf.frame(i), key, payload)
    copy = FrameBuffer(n, buf.stride, torch.device("cpu"))
    out = paged.payload_view(copy.device_view, n, copy.stride, block.HEADER_SIZE,
                             len(rows[0]))
    ids = torch.tensor(rows, dtype=torch.int64)

    def by_frame():
        return [block.verified_len(buf.frame(i)[:size], keys[i], size) for i in range(n)]

    def by_sums(sums):
        for i in range(n):
            block.verify_used(buf.frame(i)[:block.HEADER_SIZE], keys[i], payload, sums[i])
        return sums

    def by_copy():
        paged.gather(ids, out)
        return by_sums([block.payload_checksum(copy.frame(i)[block.HEADER_SIZE:size])
                        for i in range(n)])
    by_frame(), by_copy()   # raise here if any chunk fails (`by_sums` raises too)
    device = torch.device("cpu")
    secs = {"check_frame": timed(by_frame, device, reps),
            "check_copy": timed(by_copy, device, reps)}
    if paged.checksums(rows) is not None:   # the layout's pages lie in one span each
        secs["check_cache"] = timed(lambda: by_sums(paged.checksums(rows)), device, reps)
    return secs


def ceiling_seconds(buf: FrameBuffer, device, reps: int) -> dict[str, float]:
    """A plain bulk copy of the whole staging buffer each way (pinned host <-> device)."""
    host = buf.host if device.type == "cuda" else torch.empty_like(buf.host)
    dev = buf.device_view
    return {"ceiling_d2h": timed(lambda: host.copy_(dev, non_blocking=True), device, reps),
            "ceiling_h2d": timed(lambda: dev.copy_(host, non_blocking=True), device, reps)}


class _Counters:
    """The stats sink the I/O thread writes to (vLLM's stats class needs vLLM)."""

    def __init__(self):
        self.counters: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    def observe_ms(self, kind: str, ms: float) -> None:
        self.add(f"{kind}_ms", ms)


class _MemoryStore:
    """Frames by key in host memory: the part of `TieredStore` the I/O thread calls."""

    def __init__(self):
        self.frames: dict[str, bytes] = {}

    def save(self, keys, frames, hint=None):
        for key, frame in zip(keys, frames):
            block.verify(frame, key)
            self.frames[key] = bytes(frame)
        return [True] * len(keys)

    def locate(self, keys, tiers=None):
        """No chunk lies where it could be read in place: every load goes through staging."""
        return []

    def load(self, keys, outs, where=None):
        got = []
        for key, out in zip(keys, outs):
            frame = self.frames.get(key)
            if frame is None:
                got.append(-1)
                continue
            out[:len(frame)] = frame
            got.append(block.verify(out, key).payload_len)
        return got


def io_thread_check(args) -> dict:
    """Save then load `--blocks` blocks through the real I/O thread; bytes must round-trip."""
    import threading
    device = torch.device(args.device)
    paged = PagedKV(paged_cache(args, device), args.cache_blocks, args.block_size)
    m = args.chunk_tokens // args.block_size
    n = args.blocks // m
    payload = m * paged.info.block_bytes
    stride = block.frame_size(payload, block.PAGE)
    per_buf = max(1, (256 << 20) // stride)
    pools = [StagingPool(per_buf, stride, device, k) for k in (1, 2)]
    io = IOThread(_MemoryStore(), paged, pools[0], pools[1], m, payload, _Counters(),
                  threading.Lock())
    perm = torch.randperm(args.cache_blocks, generator=torch.Generator().manual_seed(1))
    src, dst = perm[: n * m].view(n, m).tolist(), perm[n * m: 2 * n * m].view(n, m).tolist()
    keys = [f"{i:048x}" for i in range(n)]
    t0 = time.perf_counter()
    for s in range(0, n, per_buf):
        buf = pools[1].acquire()
        ready = stage_save(paged, buf, src[s:s + per_buf], m)
        io.submit_save(SaveBatch("r", keys[s:s + per_buf], buf, None, ready))
    while not io.idle():
        time.sleep(0.001)
    t_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    io.submit_load([LoadBatch("r", keys[s:s + per_buf], dst[s:s + per_buf], 0,
                              last=s + per_buf >= n) for s in range(0, n, per_buf)])
    done, failed = [], set()
    while not done:
        d, f, _ = io.take_results()
        done += d
        failed |= f
        time.sleep(0.001)
    t_load = time.perf_counter() - t0
    io.stop()
    flat_src = torch.tensor(src, device=device).flatten()
    flat_dst = torch.tensor(dst, device=device).flatten()
    ok = not failed and all(torch.equal(v[flat_dst], v[flat_src]) for v in paged.views)
    return {"io_thread_round_trip_ok": ok, "io_thread_save_s": round(t_save, 4),
            "io_thread_load_s": round(t_load, 4), "io_thread_failed_blocks": len(failed)}


def parse(argv=None):
    p = argparse.ArgumentParser(prog="kvtier bench gather", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=512, help="blocks moved per save/load")
    p.add_argument("--cache-blocks", type=int, default=2048, help="blocks in the paged cache")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="LBNHC")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--per-block", action="store_true", help="also time the naive loop")
    p.add_argument("--io-thread", action="store_true",
                   help="also run the I/O thread end to end (in-memory store)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    res = run(args)
    if args.io_thread:
        res.update(io_thread_check(args))
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
