"""Routers: which instance serves a request. Policy is data: `ROUTERS = {name: class}`.

Contract: `pick(session, load) -> instance`, where `session` is the plan session (-1 for a
request without one) and `load[i]` the requests instance `i` has queued or in service now.
Routers are deterministic (ties go to the lowest instance) and keep no reference to `load`.

- `round-robin`: request n goes to instance n mod N, whatever its session (the stress case
  of the vLLM x Mooncake study: consecutive turns of a session land on different instances).
- `session-sticky`: a session stays where its first request went (that one round-robin);
  requests without a session go round-robin.
- `least-loaded`: the instance with the fewest requests queued or in service.
"""

from __future__ import annotations

from typing import Sequence


class RoundRobin:
    def __init__(self, n: int):
        self.n, self.next = n, 0

    def pick(self, session: int, load: Sequence[int]) -> int:
        i = self.next % self.n
        self.next += 1
        return i


class SessionSticky:
    def __init__(self, n: int):
        self.rr = RoundRobin(n)
        self.home: dict[int, int] = {}

    def pick(self, session: int, load: Sequence[int]) -> int:
        if session < 0:
            return self.rr.pick(session, load)
        if session not in self.home:
            self.home[session] = self.rr.pick(session, load)
        return self.home[session]


class LeastLoaded:
    def __init__(self, n: int):
        self.n = n

    def pick(self, session: int, load: Sequence[int]) -> int:
        return min(range(self.n), key=lambda i: (load[i], i))


ROUTERS = {"round-robin": RoundRobin, "session-sticky": SessionSticky,
           "least-loaded": LeastLoaded}


def make_router(name: str, n: int):
    try:
        return ROUTERS[name](n)
    except KeyError:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}") from None
