"""The eviction policy contract: what a tier keeps, what it gives up, what it brings back.

A policy is pure bookkeeping on metadata: it never sees bytes, does no I/O and imports
nothing of `tiers/`. One policy instance serves one tier (each tier may run its own kind);
the caller (`TieredStore`, or the replay simulator) owns the bytes and tells the policy what
happened to them.

Primitives:
- `on_insert(key, size, now, meta=NO_META)`: `key` of `size` bytes is now stored in the tier.
- `on_access(key, now, meta=NO_META)`: a lookup hit `key` (or a save found it present).
- `on_remove(key)`: `key` left the tier (evicted, demoted, reclaimed, deleted or corrupt).
- `select_victims(need_bytes, now, skip=()) -> list[key]`: which keys to remove, in order,
  to free at least `need_bytes`.
- Optional, for the mover: `select_demotions(now, max_bytes)` (move down proactively, with
  no capacity pressure) and `select_prefetch(now, max_bytes)` (keys of this tier to promote
  to the tier above before they are needed). Both default to nothing.
- `on_lookup(keys, now, meta_of, size_of)`: a request looked up the chain `keys` (head
  first), whatever this tier holds of it; `meta_of(key)` and `size_of(key)` answer for any
  of them. Only policies that simulate what they would have hit need it. Default: nothing.
- `on_tick(now)`: time has passed with no event on this tier (the mover calls it before it
  asks for victims, demotions or prefetches). A policy that keeps predictions of sessions
  catches up on what the session tracker learned since its last event: a turn that ended
  while this tier heard nothing. Default: nothing.

The caller guarantees:
- calls are serialized (policies are not thread-safe) and `now` never decreases;
- `on_insert` is called once the bytes are committed (never for a PENDING write); inserting a
  key that is already tracked updates its size and counts as an access;
- `on_access` and `on_remove` of an untracked key are allowed and ignored;
- `meta` carries what the session tracker knows *now* (it may change between calls: a block
  becomes shared, changes owner); `NO_META` when nothing is known;
- it applies victims with `on_remove`, in the order given, possibly only a prefix of them.

Implementations MUST:
- keep `select_victims`, `select_demotions` and `select_prefetch` free of side effects: a
  policy whose selection was not applied behaves exactly as if it had never been asked
  (a memo of a dry run is allowed only if every mutation invalidates it);
- return distinct tracked keys, none in `skip`, whose sizes add up to at least `need_bytes`,
  stopping as soon as they do; if the evictable keys cannot cover it, return all of them;
- keep `used_bytes` equal to the sum of the sizes of the tracked keys;
- use only online information (the past, the session tracker's predictions); the one
  exception is `belady`, which reads a `NextUse` oracle and exists only for replay;
- evict a session's chain from its TAIL: a prefix hit stops at the first missing block, so a
  missing head wastes every block behind it (positions come in `BlockMeta.position`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

Key = Hashable


class BlockMeta(NamedTuple):
    """What the session tracker knows about a block at the time of a call."""

    session: Hashable | None = None  # the live session whose chain most recently held it
    position: int = 0                # index of the block in that chain (0 = head)
    shared_by: int = 1               # live sessions whose chains hold it (refcount)


NO_META = BlockMeta()


class SessionView(Protocol):
    """The session tracker's predictions, as policies read them (`store.sessions.tracker`)."""

    def reuse_probability(self, session: Hashable, now: float, horizon_s: float) -> float:
        """P(the session's next turn arrives in (now, now + horizon_s]); 0 when ended."""

    def predicted_return(self, session: Hashable, now: float, quantile: float) -> float:
        """Absolute time by which its next turn has arrived with probability `quantile`,
        given it has not arrived by `now`; `inf` when that probability is never reached."""

    def snapshot(self, session: Hashable):
        """The inputs of the prediction (`store.sessions.predict.Snapshot`: last turn end,
        mu and sigma of the log gap, P(another turn), active, the row of `shapes` its
        standardized log gap follows), or None when unknown."""

    @property
    def shapes(self):
        """The learned shapes of standardized log gaps (`store.sessions.gap_shape.ShapeTable`)."""

    def hot_until(self, session: Hashable, quantile: float) -> float:
        """Absolute time until which the session is hot (its turn end plus the `quantile` of
        its gap distribution); inf while a turn is served, -inf if unknown."""

    def is_active(self, session: Hashable) -> bool:
        """True while a turn of the session is being served (arrived, not yet ended)."""

    def changes(self, cursor: int) -> tuple[list | None, int]:
        """Sessions whose state changed since `cursor` (0 at first) and the new cursor; None
        for the list when the cursor is too old (re-read every session)."""


class NextUse(Protocol):
    """The future, for the offline oracle: when is `key` looked up next (inf if never)."""

    def next_use(self, key: Key) -> float: ...


@dataclass(frozen=True)
class PolicyContext:
    """What a policy instance needs besides its config."""

    capacity_bytes: int
    tier: str = ""
    sessions: SessionView | None = None   # agentic: live sessions and their predictions
    future: NextUse | None = None         # belady only (replay)
    restore_bytes_per_s: float = 2e9      # bandwidth from this tier to the one above
    # bytes of one block, where the caller knows it (a replay whose keys are runs of blocks);
    # None: the size of the first key seen (a tier's keys are single blocks)
    block_bytes: int | None = None


class EvictionPolicy(ABC):
    """Base class of every policy; see the module docstring for the contract."""

    kind: ClassVar[str]
    needs_future: ClassVar[bool] = False
    needs_sessions: ClassVar[bool] = False

    def __init__(self, config: Any, ctx: PolicyContext):
        self.config = config
        self.ctx = ctx
        self.capacity_bytes = ctx.capacity_bytes
        self.used_bytes = 0

    @abstractmethod
    def on_insert(self, key: Key, size: int, now: float, meta: BlockMeta = NO_META) -> None:
        """`key` of `size` bytes is now stored in this tier."""

    @abstractmethod
    def on_access(self, key: Key, now: float, meta: BlockMeta = NO_META) -> None:
        """A lookup (or a deduplicated save) touched `key`."""

    @abstractmethod
    def on_remove(self, key: Key) -> None:
        """`key` left this tier, for whatever reason."""

    @abstractmethod
    def select_victims(self, need_bytes: int, now: float,
                       skip: Collection[Key] = ()) -> list[Key]:
        """Keys to remove, in order, freeing at least `need_bytes`. No side effects."""

    def on_lookup(self, keys, now: float, meta_of, size_of) -> None:
        """A request looked up the chain `keys`, hit or miss (default: not needed)."""

    def on_tick(self, now: float) -> None:
        """Time has passed with no event on this tier (default: nothing to catch up on)."""

    def select_demotions(self, now: float, max_bytes: int) -> list[Key]:
        """Keys to move down now although the tier is not full (default: none)."""
        return []

    def select_prefetch(self, now: float, max_bytes: int) -> list[Key]:
        """Keys of this tier worth copying up to the tier above now (default: none)."""
        return []

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


def take_until(keys, sizes: dict, need_bytes: int, skip: Collection[Key],
               out: list[Key], freed: int) -> int:
    """Append keys (in the given order, skipping `skip`) to `out` until `freed` reaches
    `need_bytes`; return the new `freed`. Shared by the policies' dry runs."""
    for key in keys:
        if freed >= need_bytes:
            break
        if key in skip:
            continue
        out.append(key)
        freed += sizes[key]
    return freed
