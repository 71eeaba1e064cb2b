"""`kvtier replay --engine sim`: N simulated instances on a real kvtier cluster, virtual time.

A discrete-event simulation replaces the model, and only the model:
- each instance is one server with a FIFO queue: a request occupies it for its prefill time,
  given by the calibrated model (`tools.replay.prefill_model`) from the tokens it computes and the
  tokens it loads from each tier; its response then streams at the model's decode rate
  without holding the instance (continuous batching);
- vLLM's own prefix cache is modeled per instance as an LRU of blocks holding `local_blocks`
  (the instance's KV cache), filled tail first so that eviction takes a request's tail
  before its head, as vLLM frees blocks;
- the kvtier part is real: each instance is a process with its own `TieredStore`
  (`tools.replay.sim_worker`), lending its own pool segment to one real `mooncake_master`,
  with its own index and nvme dir and one shared dir. Lookups, loads (verified bytes, each
  frame checked against its key: `wrong_blocks` in the record must be 0) and
  saves happen in event order at the virtual time they happen, so hits, tiers and bytes are
  what the store really did. Store calls are made one at a time, so the measured load times
  (reported, not used by the model) are not skewed by contention.
The times and the throughput are modeled (virtual seconds); the hit rates are measured.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import Callable

from kvtier.tools.replay.plan import Plan
from kvtier.tools.replay.prefill_model import PrefillModel
from kvtier.tools.replay.sim_worker import SimWorker


class LocalCache:
    """vLLM's prefix cache on one instance: an LRU of block keys."""

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[str, None] = OrderedDict()

    def match(self, keys: list[str]) -> int:
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        return n

    def insert(self, keys: list[str]) -> None:
        for k in reversed(keys):  # the head ends most recent: evicted last
            self.blocks[k] = None
            self.blocks.move_to_end(k)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class _Inst:
    def __init__(self, local_blocks: int, worker: SimWorker | None):
        self.cache = LocalCache(local_blocks)
        self.worker = worker
        self.queue: deque = deque()
        self.busy = False
        self.load = 0


class SimRun:
    """One configuration's simulation (workers already started, or None for local-only)."""

    def __init__(self, plan: Plan, workers: list[SimWorker | None], router,
                 model: PrefillModel, tier_kinds: dict[str, str], local_blocks: int,
                 ns_fingerprint: str, payload_bytes: int, speed: float = 1.0):
        self.plan, self.router, self.model, self.speed = plan, router, model, speed
        self.kinds, self.fp, self.payload = tier_kinds, ns_fingerprint, payload_bytes
        self.insts = [_Inst(local_blocks, w) for w in workers]
        self.events: list = []
        self.seq = 0
        self.records: list[dict | None] = [None] * len(plan)

    def _push(self, t: float, kind: str, data) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def run(self, progress: Callable[[int], None] | None = None) -> list[dict]:
        for i in self.plan.first_requests():
            self._push(self.plan.arrival_s[i] / self.speed, "arrive", i)
        done = 0
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            if kind == "arrive":
                k = self.router.pick(int(self.plan.session[data]),
                                     [x.load for x in self.insts])
                inst = self.insts[k]
                inst.load += 1
                inst.queue.append((data, t))
                if not inst.busy:
                    self._start(k, t)
            else:
                self._finish(data, t)
                done += 1
                if progress:
                    progress(done)
        return self.records  # type: ignore[return-value]

    def _start(self, k: int, t: float) -> None:
        inst, plan, bt = self.insts[k], self.plan, self.plan.block_tokens
        i, sent = inst.queue.popleft()
        keys = plan.keys(i, self.fp)
        cap = min(len(keys), (int(plan.input_tokens[i]) - 1) // bt)  # one token to compute
        local = min(inst.cache.match(keys), cap)
        hit, tiers, load_s, wrong = local, [], 0.0, 0
        if inst.worker is not None:
            sid = f"s{int(plan.session[i])}" if plan.session[i] >= 0 else None
            got, tiers, load_s, wrong = inst.worker.call("request", keys[:cap], local, sid, t)
            hit = max(local, got)
        loaded: dict[str, int] = {}
        for name in tiers:
            loaded[name] = loaded.get(name, 0) + bt
        cached = hit * bt
        new = int(plan.input_tokens[i]) - cached
        by_kind = {self.kinds[n]: v for n, v in loaded.items()}
        service = self.model.ttft(new, cached, by_kind)
        inst.busy = True
        self._push(t + service, "done",
                   (k, i, sent, t, keys, local, hit, loaded, load_s, wrong))

    def _finish(self, data, t: float) -> None:
        k, i, sent, start, keys, local, hit, loaded, load_s, wrong = data
        inst, plan = self.insts[k], self.plan
        n_full = int(plan.input_tokens[i]) // plan.block_tokens
        saved = 0
        if inst.worker is not None:
            sid = f"s{int(plan.session[i])}" if plan.session[i] >= 0 else None
            saved = inst.worker.call("save", keys[hit:n_full], keys[:n_full], sid, t)
        inst.cache.insert(keys[:n_full])
        out = int(plan.output_tokens[i])
        end = t + (out - 1) * self.model.decode_s
        self.records[i] = {
            "i": i, "session": int(plan.session[i]), "turn": int(plan.turn[i]),
            "instance": k, "input_tokens": int(plan.input_tokens[i]), "output_tokens": out,
            "sent": sent, "start": start, "end": end, "ttft": t - sent, "e2e": end - sent,
            "cached": hit * plan.block_tokens, "tiers": loaded, "saved_chunks": saved,
            "load_s": load_s, "wrong_blocks": wrong}
        inst.load -= 1
        nxt = int(plan.next_in_session[i])
        if nxt >= 0:
            self._push(end + plan.think_s[nxt] / self.speed, "arrive", nxt)
        inst.busy = False
        if inst.queue:
            self._start(k, t)
