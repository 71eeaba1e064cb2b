"""Raw `mooncake.store` batch calls with registered buffers: the mooncake tier's reference.

`kvtier bench tiers` measures the tier against what Mooncake itself does for the same
requests (same replication and soft pin, same pool, same buffers), with none of the tier's
work: no header parsing, no verification, no staging, pointers computed once. It lives in
`tiers/` because only `tiers/` imports `mooncake`.
"""

from __future__ import annotations

from typing import Sequence

from kvtier.store.base.config import MasterConfig, MooncakeTierConfig
from kvtier.store.base.errors import TierError
from kvtier.tiers.mooncake.client import OK, MooncakeClient


class RawMooncake:
    """A second store client of this process that issues bare batch calls."""

    def __init__(self, cfg: MooncakeTierConfig, master: MasterConfig):
        self.client = MooncakeClient(cfg, master)
        self.store = self.client._handle.store  # no reconnects: a failure fails the bench

    def register(self, buf) -> int:
        """Register `buf` and return its address."""
        return self.client.register(buf)

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> None:
        codes = self.store.batch_put_from(keys, ptrs, sizes, self.client.replicate)
        _check("batch_put_from", codes, lambda c: c == OK)

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> None:
        codes = self.store.batch_get_into(keys, ptrs, sizes)
        _check("batch_get_into", codes, lambda c: c >= 0)

    def remove(self, keys: list[str]) -> None:
        self.store.batch_remove(keys, True)

    def close(self) -> None:
        self.client.close()


def _check(op: str, codes: Sequence[int], good) -> None:
    bad = [c for c in codes if not good(c)]
    if bad:
        raise TierError(f"raw {op} failed for {len(bad)} of {len(codes)} keys (first code "
                        f"{bad[0]}); the reference run is invalid: check the master's log")
