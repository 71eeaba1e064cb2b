"""One `TieredStore` per process and policy, shared by the connector sides that live there.

With vLLM's in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uni executor) the
scheduler side and the worker side run in one process: they share one store (one Mooncake
client, one index handle) instead of opening two. The worker is built first and asks for the
mover; a scheduler-only process gets a lookup-only store (`mover=False`, lending no pool
memory), which gains a mover if a worker side joins it later (still lending none: its puts
go to other processes' segments). Reference counted: the last `release` closes the store.
The sides of one process also share the end of each engine step (`on_step_end`): the
scheduler side sees a step's outputs go out, which no worker hook does.
"""

from __future__ import annotations

import threading
from typing import Callable

from kvtier.store.base.config import Policy
from kvtier.store.tiered import TieredStore

_lock = threading.Lock()
_stores: dict[tuple[str, str | None], list] = {}  # key -> [store, refcount]
# key -> the calls to make at a step's end; replaced whole under `_lock`, read without it
_step_ends: dict[tuple[str, str | None], tuple[Callable[[], None], ...]] = {}


def _key(policy: Policy, node_id: str | None) -> tuple[str, str | None]:
    return (str(policy.index.path), node_id)


def acquire(policy: Policy, node_id: str | None, mover: bool) -> TieredStore:
    """The process's store for `policy` (opened on first use)."""
    key = _key(policy, node_id)
    with _lock:
        entry = _stores.get(key)
        if entry is not None:
            entry[1] += 1
            if mover:  # the lookup-only side came first: this side moves blocks after all
                entry[0].start_mover()
            return entry[0]
        # A lookup-only store lends no pool memory: in a process of its own it never stores.
        store = TieredStore(policy, node_id=node_id, mover=mover, lend=mover)
        _stores[key] = [store, 1]
        return store


def release(store: TieredStore) -> bool:
    """Drop one reference; close the store when it was the last (then True)."""
    with _lock:
        for key, entry in list(_stores.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] > 0:
                    return False
                del _stores[key]
                break
        else:
            return False
    store.close()
    return True


def on_step_end(policy: Policy, node_id: str | None,
                fn: Callable[[], None]) -> Callable[[], None]:
    """Call `fn` whenever this process's scheduler side for `policy` ends a step
    (`step_ended`); returns the call that stops it."""
    key = _key(policy, node_id)
    with _lock:
        _step_ends[key] = _step_ends.get(key, ()) + (fn,)

    def stop() -> None:
        with _lock:
            fns = tuple(f for f in _step_ends.get(key, ()) if f is not fn)
            if fns:
                _step_ends[key] = fns
            else:
                _step_ends.pop(key, None)
    return stop


def step_ended(policy: Policy, node_id: str | None) -> None:
    """A step's outputs are out: tell the worker sides of this process (none: nothing).
    Called every step, so it reads the listeners without the lock."""
    for fn in _step_ends.get(_key(policy, node_id), ()):
        fn()
