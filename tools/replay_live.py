"""The real-time driver of `kvtier replay --engine vllm`: sends a plan to N engines as it
would happen, and records what each request got.

One thread per instance serves its queue: it takes every request waiting (up to
`max_batch`) and hands them to its backend in one call (vLLM batches them: continuous
batching within the call; a request that arrives meanwhile waits for the next call). The
main thread releases requests when they are due (`tools.replay_plan` timing, divided by
`speed`), routes each one (`tools.replay_router`, by the instances' current load) and, when
a response ends, schedules the session's next request.

Backend contract: `serve(batch: list[int]) -> list[dict]`, one dict per request with
`cached` (tokens served from any cache), `tiers` ({tier: tokens loaded from kvtier}),
`saved_chunks`, `ttft_s` (from the call's start) and `output_tokens`; it may raise, which
stops the replay with the error. Record times are seconds since the replay started:
`ttft = (start - sent) + ttft_s`, `e2e = end - sent`.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque
from typing import Callable, Sequence

from kvtier.tools.replay_plan import Plan


class _Instance:
    def __init__(self, idx: int, backend, max_batch: int, done: queue.Queue):
        self.idx, self.backend, self.max_batch, self.done = idx, backend, max_batch, done
        self.waiting: deque = deque()
        self.load = 0  # queued + in service (read by the router under the driver's lock)
        self.cv = threading.Condition()
        self.stop = False
        self.thread = threading.Thread(target=self._run, name=f"replay-{idx}", daemon=True)

    def submit(self, item) -> None:
        with self.cv:
            self.waiting.append(item)
            self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.waiting and not self.stop:
                    self.cv.wait()
                if self.stop:
                    return
                batch = [self.waiting.popleft()
                         for _ in range(min(self.max_batch, len(self.waiting)))]
            start = time.monotonic()
            try:
                results = self.backend.serve([i for i, _ in batch])
            except BaseException as e:  # surfaced by the driver, which stops the replay
                self.done.put(("error", self.idx, e))
                return
            end = time.monotonic()
            for (i, sent), res in zip(batch, results):
                self.done.put(("done", self.idx, (i, sent, start, end, res)))


def run_live(plan: Plan, backends: Sequence, router, speed: float = 1.0,
             max_batch: int = 8, progress: Callable[[int], None] | None = None) -> list[dict]:
    """Replay `plan` against `backends` (one per instance); the records in plan order."""
    done: queue.Queue = queue.Queue()
    insts = [_Instance(k, b, max_batch, done) for k, b in enumerate(backends)]
    for inst in insts:
        inst.thread.start()
    t0 = time.monotonic()
    due = [(plan.arrival_s[i] / speed, i) for i in plan.first_requests()]
    heapq.heapify(due)
    records: list[dict | None] = [None] * len(plan)
    finished = 0
    try:
        while finished < len(plan):
            now = time.monotonic() - t0
            while due and due[0][0] <= now:
                _, i = heapq.heappop(due)
                k = router.pick(int(plan.session[i]), [x.load for x in insts])
                insts[k].load += 1
                insts[k].submit((i, time.monotonic() - t0))
            wait = max(0.0, due[0][0] - now) if due else 1.0
            try:
                kind, k, payload = done.get(timeout=min(wait, 1.0))
            except queue.Empty:
                continue
            if kind == "error":
                raise payload
            insts[k].load -= 1
            i, rec = _record(plan, k, payload, t0)
            records[i] = rec
            finished += 1
            nxt = int(plan.next_in_session[i])
            if nxt >= 0:
                heapq.heappush(due, (rec["end"] + plan.think_s[nxt] / speed, nxt))
            if progress:
                progress(finished)
    finally:
        for inst in insts:
            with inst.cv:
                inst.stop = True
                inst.cv.notify()
    return records  # type: ignore[return-value]


def _record(plan: Plan, k: int, payload, t0: float) -> tuple[int, dict]:
    i, sent, start, end, res = payload
    start, end = start - t0, end - t0
    ttft_in_call = res.get("ttft_s")
    if not ttft_in_call or ttft_in_call <= 0:
        ttft_in_call = end - start  # no per-request metric: the whole call bounds it
    return i, {
        "i": i, "session": int(plan.session[i]), "turn": int(plan.turn[i]), "instance": k,
        "input_tokens": int(plan.input_tokens[i]), "output_tokens": res["output_tokens"],
        "sent": sent, "start": start, "end": end,
        "ttft": (start - sent) + ttft_in_call, "e2e": end - sent,
        "cached": int(res["cached"]), "tiers": dict(res.get("tiers") or {}),
        "saved_chunks": int(res.get("saved_chunks", 0)), "load_s": res.get("load_s")}
