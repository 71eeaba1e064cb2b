"""kvtier's storage tiers, one sub-package per kind, each behind the contract of `tiers.base`.

`open_tier(cfg, ctx)` (`tiers.registry`) builds the tier a policy entry names. Backends
(`mooncake.store`, `liburing`, `aiofiles`) are imported lazily inside the tier modules, with
an install hint.
"""

from kvtier.tiers.base import MISS, InPlaceRun, Tier, TierContext, TierCounters
from kvtier.tiers.registry import TIER_IMPLS, open_tier

__all__ = ["MISS", "InPlaceRun", "Tier", "TierContext", "TierCounters", "TIER_IMPLS",
           "open_tier"]
