"""A thread's CPU priority: work nobody waits for yields to the work somebody does."""

from __future__ import annotations

import os
import threading

LEAST_PRIORITY = 19  # the highest nice value: runs when nothing else wants the CPU


def deprioritize(tid: int | None = None) -> None:
    """Lower thread `tid` (the calling thread if None) to the least CPU priority; Linux
    keeps a nice value per thread. Where it cannot (another OS, not allowed, the thread
    gone) nothing changes: the work only costs more CPU beside others."""
    if not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id() if tid is None else tid,
                       LEAST_PRIORITY)
    except OSError:
        pass
