"""Which class serves each tier kind, and how a policy's tier entry becomes an open tier.

Policy is data: `TIER_IMPLS` maps a `kind` to (module, class), imported on first use, so a
tier whose backend is not installed costs nothing until a policy names it.
"""

from __future__ import annotations

import importlib

from kvtier.tiers.base import Tier, TierContext

# kind -> (module, class); policy is data, no if/elif on names.
TIER_IMPLS: dict[str, tuple[str, str]] = {
    "mooncake": ("kvtier.tiers.mooncake.tier", "MooncakeTier"),
    "nvme": ("kvtier.tiers.nvme.tier", "NvmeTier"),
    "sharedfs": ("kvtier.tiers.sharedfs.tier", "SharedFSTier"),
}


def open_tier(cfg, ctx: TierContext) -> Tier:
    """Build and open the tier described by `cfg` (a tier config of the policy)."""
    module, cls = TIER_IMPLS[cfg.kind]
    return getattr(importlib.import_module(module), cls)(cfg, ctx)
