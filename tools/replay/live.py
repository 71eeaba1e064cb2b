"""The real-time driver of `kvtier replay --engine vllm`: sends a plan to N engines as it
would happen, and records what each request got.

Requests go to their instance the moment they are due, one at a time, and the engine runs
each alongside those already running (continuous batching, as behind `vllm serve`): nothing
waits for a batch to end. An instance takes at most `max_inflight` requests at once (vLLM's
`max_num_seqs`); a request due while its instance is full waits in the instance's queue, and
that wait counts in its TTFT. The main thread releases requests when they are due
(`tools.replay.plan` timing, divided by `speed`), routes each one (`tools.replay.router`, by
the instances' current load) and, when a response ends, schedules the session's next request.

Backend contract: `submit(i: int, done: Callable[[dict | BaseException], None])` sends
request `i` without waiting, and `done` is called once, from any thread, with a dict:
`cached` (tokens served from any cache), `tiers` ({tier: tokens loaded from kvtier}),
`saved_chunks`, `ttft_s` and `e2e_s` (from the request reaching the engine), `output_tokens`,
and optionally `added_s`, `queued_s`, `prefill_s` (where the engine's time went, copied to
the record) -- or with the exception that failed it, which stops the replay (as does a
request still in flight after `REQUEST_TIMEOUT_S`). Record times
are seconds since the replay started: `start` when the request was handed to the engine,
`end` when its response came back, `ttft = (start - sent) + ttft_s`, `e2e = end - sent`.
"""

from __future__ import annotations

import heapq
import queue
import time
from collections import deque
from typing import Callable, Sequence

from kvtier.tools.replay.plan import Plan

DETAIL = ("added_s", "queued_s", "prefill_s", "preemptions")  # engine-side breakdown, if any
REQUEST_TIMEOUT_S = 600.0  # a request in flight longer than this stops the replay (a hung engine)


class _Instance:
    """One engine's queue; touched only by the driver's thread."""

    def __init__(self, idx: int, backend, max_inflight: int):
        self.idx, self.backend, self.max_inflight = idx, backend, max_inflight
        self.waiting: deque = deque()
        self.inflight = 0
        self.since: dict[int, float] = {}  # request -> when it was handed to the engine

    @property
    def load(self) -> int:  # queued + in service (what the router balances)
        return len(self.waiting) + self.inflight

    def dispatch(self, done: queue.Queue, t0: float) -> None:
        """Hand the engine what it has room for."""
        while self.waiting and self.inflight < self.max_inflight:
            i, sent = self.waiting.popleft()
            self.inflight += 1
            start = self.since[i] = time.monotonic() - t0

            def finished(res, i=i, sent=sent, start=start) -> None:
                end = time.monotonic() - t0
                if isinstance(res, BaseException):
                    done.put(("error", self.idx, res))
                else:
                    done.put(("done", self.idx, (i, sent, start, end, res)))

            self.backend.submit(i, finished)


def run_live(plan: Plan, backends: Sequence, router, speed: float = 1.0,
             max_inflight: int = 8, progress: Callable[[int], None] | None = None
             ) -> list[dict]:
    """Replay `plan` against `backends` (one per instance); the records in plan order."""
    done: queue.Queue = queue.Queue()
    insts = [_Instance(k, b, max_inflight) for k, b in enumerate(backends)]
    t0 = time.monotonic()
    due = [(plan.arrival_s[i] / speed, i) for i in plan.first_requests()]
    heapq.heapify(due)
    records: list[dict | None] = [None] * len(plan)
    finished = 0
    while finished < len(plan):
        now = time.monotonic() - t0
        while due and due[0][0] <= now:
            _, i = heapq.heappop(due)
            inst = insts[router.pick(int(plan.session[i]), [x.load for x in insts])]
            inst.waiting.append((i, time.monotonic() - t0))
            inst.dispatch(done, t0)
        _check_hung(insts, now)
        wait = max(0.0, due[0][0] - now) if due else 1.0
        try:
            kind, k, payload = done.get(timeout=min(wait, 1.0))
        except queue.Empty:
            continue
        if kind == "error":
            raise payload
        insts[k].inflight -= 1
        del insts[k].since[payload[0]]
        insts[k].dispatch(done, t0)
        i, rec = _record(plan, k, payload)
        records[i] = rec
        finished += 1
        nxt = int(plan.next_in_session[i])
        if nxt >= 0:
            heapq.heappush(due, (rec["end"] + plan.think_s[nxt] / speed, nxt))
        if progress:
            progress(finished)
    return records  # type: ignore[return-value]


def _check_hung(insts: list[_Instance], now: float) -> None:
    for inst in insts:
        for i, start in inst.since.items():
            if now - start > REQUEST_TIMEOUT_S:
                raise TimeoutError(f"request {i} has been on instance {inst.idx} for "
                                   f"{now - start:.0f} s (a hung engine? see its log)")


def _record(plan: Plan, k: int, payload) -> tuple[int, dict]:
    i, sent, start, end, res = payload
    ttft_in_engine = res.get("ttft_s")
    if not ttft_in_engine or ttft_in_engine <= 0:
        ttft_in_engine = end - start  # no per-request metric: the whole request bounds it
    return i, {
        "i": i, "session": int(plan.session[i]), "turn": int(plan.turn[i]), "instance": k,
        "input_tokens": int(plan.input_tokens[i]), "output_tokens": res["output_tokens"],
        "sent": sent, "start": start, "end": end,
        "ttft": (start - sent) + ttft_in_engine, "e2e": end - sent,
        "cached": int(res["cached"]), "tiers": dict(res.get("tiers") or {}),
        "saved_chunks": int(res.get("saved_chunks", 0)), "load_s": res.get("load_s"),
        # promised by a lookup and recomputed; found and recomputed as faster (`metrics`)
        "recomputed": int(res.get("recomputed", 0)), "declined": int(res.get("declined", 0)),
        **{key: res[key] for key in DETAIL if res.get(key) is not None}}
