"""What the scheduler side tells the worker side each step (pickled across processes).

A job moves whole chunks of one KV cache group (`group`, vLLM's index): `keys[i]` (rank-0
namespace of that group) is chunk i, `block_ids[i]` its `chunk_tokens / block_size` vLLM
block ids of that group in token order.

- `LoadJob`: read the chunks and scatter them into the blocks; the first `skip_first`
  blocks of chunk 0 already hold a local prefix hit and are not written. `tiers[i]` is
  where the lookup found chunk i (a hint: the load asks that tier first). An asynchronous
  job's request is reported in `finished_recving` when done; a `sync` job is done before
  the step's forward (its request runs in this step). Either way every block the worker
  could not fill goes out through `get_block_ids_with_load_errors` (so vLLM recomputes
  from the first of them).
- `SaveJob`: gather the chunks from the blocks and save them. The blocks must hold the KV of
  the chunk's tokens during the step the job arrives in (the worker gathers in
  `wait_for_save`, after that step's forward).
- `hold`: requests that finished while the scheduler keeps their blocks for our saves;
  the worker reports each in `finished_sending` once no save still reads its blocks.
- `events`: when the workers run in other processes than the scheduler (`vllm serve` with a
  multiprocess executor), the lookups and turn ends the scheduler saw, in order, for the
  store whose mover evicts and prefetches by them (`StoreEvent`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                              KVConnectorWorkerMetadata)

from kvtier.store.tiered import SessionHint


@dataclass
class LoadJob:
    req_id: str
    keys: list[str]
    block_ids: list[list[int]]
    skip_first: int = 0
    tiers: list[str] = field(default_factory=list)
    sync: bool = False
    deadline_s: float | None = None  # from when the worker takes it; None: no deadline
    group: int = 0
    grace_s: float = 0.0  # the least time the load gets from its start, however late


@dataclass
class SaveJob:
    req_id: str
    keys: list[str]
    block_ids: list[list[int]]
    hint: SessionHint | None = None
    group: int = 0


@dataclass
class StoreEvent:
    """`lookup`: a request's chain was looked up, chunks [held, hits) may be loaded;
    `finish`: the request over that chain ended (its session's turn is over; the hint's
    `gap_class` says what it waits for)."""

    kind: str
    keys: list[str]
    hits: int = 0
    held: int = 0
    hint: SessionHint | None = None


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    hold: list[str] = field(default_factory=list)
    events: list[StoreEvent] = field(default_factory=list)
    # what this step's forward computes, (tokens, attention work) of `RecomputeModel`: the
    # workers time the forward and send it back, so the scheduler learns the engine's cost
    work: tuple[float, float] = (0.0, 0.0)
    # whether some request of the step computes more than one token (a prefill), and
    # which ones are left with prompt tokens to compute after it: the workers' movers
    # yield to a prefill until it ends; on a CPU cache those requests' saves wait for it
    prefill: bool = False
    prefilling: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.loads or self.saves or self.hold or self.events)

    @property
    def prefill_continues(self) -> bool:
        """Whether some request still has prompt tokens to compute after this step."""
        return bool(self.prefilling)


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step: for each load job that ended,
    (request, rank, chunks loaded), the prefix that landed there, so a hit counts only what
    was loaded (every rank loads its own share of every chunk, each in its own time: the
    scheduler counts a chunk once every rank has reported, as loaded only where all did);
    and the forwards they timed, for the scheduler's `RecomputeModel`."""

    settled: list[tuple[str, int, int]] = field(default_factory=list)
    # (tokens, attention work, seconds) of forwards this worker timed
    steps: list[tuple[float, float, float]] = field(default_factory=list)

    def aggregate(self, other: "KVTierWorkerMeta") -> "KVTierWorkerMeta":
        self.settled = self.settled + other.settled
        self.steps = self.steps + other.steps
        return self
