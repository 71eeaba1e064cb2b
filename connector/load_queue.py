"""The order the I/O thread takes load batches in: earliest deadline first.

One thread serves every request's loads. Taken in arrival order, a short load queued behind
a long one waited out its whole deadline there and was recomputed with its data in place
(seen on the WEKA replay: loads of a few chunks behind one of 271). Taking the batch whose
deadline comes first meets every deadline that any order would meet (EDF on one server,
here at the grain of a batch), and the long load, whose deadline is long because recomputing
it is, gives up only the short loads' time. Batches of one deadline (a request's own, which
must run in order) keep their arrival order; batches with no deadline come after every one
that has one, in arrival order.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Protocol


class _Batch(Protocol):
    deadline: float | None


class LoadQueue:
    """Load batches, taken earliest deadline first (ties and no deadline: arrival order).
    Not thread-safe: the I/O thread's lock guards it."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Batch]] = []
        self._seq = itertools.count()

    def extend(self, batches) -> None:
        for b in batches:
            due = math.inf if b.deadline is None else b.deadline
            heapq.heappush(self._heap, (due, next(self._seq), b))

    def pop(self) -> _Batch:
        """The batch due first; IndexError when empty."""
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)
