"""`in_threads(jobs)`: run callables in parallel threads (engines and instances start at
once: each spends most of its start-up outside the GIL); the first failure is re-raised on
the caller's thread once every job has ended, so nothing is left running behind it."""

from __future__ import annotations

import threading
from typing import Callable, Iterable


def in_threads(jobs: Iterable[Callable[[], object]]) -> None:
    errors: list[BaseException] = []

    def wrap(job) -> None:
        try:
            job()
        except BaseException as e:  # re-raised below, on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
