"""kvtier's exceptions.

Every error a user can cause carries a one-line message that names the cause and the fix.
A miss is never an exception: tiers return it as a value. Backend codes (Mooncake return
codes, LMDB errors, errno) are translated into these classes at the boundary where they occur.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KVTierError):
    """A policy file or connector config is invalid; the message names file, field and fix."""


class TierError(KVTierError):
    """A storage tier failed in a way the caller may handle (retry, skip the tier)."""


class TierFullError(TierError):
    """The tier has no room and nothing it may evict on its own; nothing was torn.

    `stored`: the keys of the batch that were stored before the tier filled up."""

    def __init__(self, message: str, stored=()):
        super().__init__(message)
        self.stored: list[str] = list(stored)


class TierUnavailableError(TierError):
    """The tier's backend cannot be reached (master down, mount gone); retry later."""


class IndexError_(KVTierError):
    """The LMDB index cannot be opened or written (full map, wrong namespace, bad version)."""


class IndexFullError(IndexError_):
    """The index map is full and may not grow further."""


class MasterError(KVTierError):
    """The Mooncake master binary is missing, cannot start, or does not answer."""


class CorruptBlockError(KVTierError):
    """A stored block failed verification; callers turn it into a miss plus a quarantine."""
