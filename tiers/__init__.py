"""kvtier's storage tiers, one module per kind, each behind the contract of `tiers.base`.

`open_tier(cfg, ctx)` builds the tier a policy entry names. Backends (`mooncake.store`,
`liburing`, `aiofiles`) are imported lazily inside the tier modules, with an install hint.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kvtier.store.config import MasterConfig
from kvtier.store.index import Index
from kvtier.tiers.base import MISS, Tier, TierCounters

# kind -> (module, class); policy is data, no if/elif on names.
TIER_IMPLS: dict[str, tuple[str, str]] = {
    "mooncake": ("kvtier.tiers.mooncake", "MooncakeTier"),
    "nvme": ("kvtier.tiers.nvme", "NvmeTier"),
    "sharedfs": ("kvtier.tiers.sharedfs", "SharedFSTier"),
}


@dataclass(frozen=True)
class TierContext:
    """What a tier needs besides its own config: the node's index and identity.

    `recover`: run crash recovery at open (drop dead writers' PENDING entries, adopt their
    regions, sweep stale temp files). `kvtier inspect check` opens tiers with False, so the
    leftovers are still there to be reported (and repaired only with `--fix`).
    `lend`: this process lends pool memory (its Mooncake segment); a process that only asks
    what the pool holds (vLLM's scheduler, its workers elsewhere) lends none.
    """

    index: Index
    node_id: str
    master: MasterConfig
    recover: bool = True
    lend: bool = True


def open_tier(cfg, ctx: TierContext) -> Tier:
    """Build and open the tier described by `cfg` (a tier config of the policy)."""
    module, cls = TIER_IMPLS[cfg.kind]
    return getattr(importlib.import_module(module), cls)(cfg, ctx)


__all__ = ["MISS", "Tier", "TierContext", "TierCounters", "TIER_IMPLS", "open_tier"]
