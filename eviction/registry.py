"""The registry of eviction policies: kind -> (config class, implementation). Policy is data."""

from __future__ import annotations

from kvtier.eviction.agentic import AgenticPolicy
from kvtier.eviction.arc import ARCPolicy
from kvtier.eviction.base import EvictionPolicy, PolicyContext
from kvtier.eviction.belady import BeladyPolicy
from kvtier.eviction.lru import LRUPolicy
from kvtier.eviction.s3fifo import S3FIFOPolicy
from kvtier.eviction.selecting import SelectingPolicy
from kvtier.store.base.errors import ConfigError
from kvtier.store.base.policies import EVICTION_KINDS

_IMPLS: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "belady": BeladyPolicy,
    "agentic": AgenticPolicy,
}

EVICTION_POLICIES: dict[str, tuple[type, type[EvictionPolicy]]] = {
    kind: (EVICTION_KINDS[kind], impl) for kind, impl in _IMPLS.items()
}


def make_policy(config, ctx: PolicyContext) -> EvictionPolicy:
    """Build the policy `config` describes (a config object of `store.base.policies`, or a kind
    string for the defaults) for one tier."""
    if isinstance(config, str):
        if config not in EVICTION_POLICIES:
            raise ConfigError(f"unknown eviction kind {config!r}; known: "
                              f"{', '.join(EVICTION_POLICIES)}")
        config = EVICTION_POLICIES[config][0](kind=config)
    cfg_cls, impl = EVICTION_POLICIES[config.kind]
    if impl.needs_sessions and ctx.sessions is None:
        raise ConfigError(f"eviction kind {config.kind!r} needs the session tracker")
    if getattr(config, "select", False):
        return SelectingPolicy(config, ctx, make_policy)
    return impl(config, ctx)
