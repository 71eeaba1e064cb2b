"""kvtier.eviction: eviction policies and admission filters, pure logic on metadata.

`EVICTION_POLICIES` maps a `kind` to (config class, implementation); `make_policy` builds one
from its config. The contract is in `eviction.base`.
"""

from __future__ import annotations

from kvtier.eviction.base import (NO_META, BlockMeta, EvictionPolicy, NextUse, PolicyContext,
                                  SessionView)
from kvtier.eviction.registry import EVICTION_POLICIES, make_policy

__all__ = ["NO_META", "BlockMeta", "EvictionPolicy", "NextUse", "PolicyContext", "SessionView",
           "EVICTION_POLICIES", "make_policy"]
