"""Config schemas of the eviction and admission policies, keyed by `kind`.

These are plain data; the implementations live in `eviction/` under the same kind strings.
Adding a policy means adding its config class here and its implementation there.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from kvtier.store.base.units import parse_rate

Rate = Annotated[float, BeforeValidator(parse_rate)]
_FROZEN = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class LRUConfig(BaseModel):
    """Least recently used."""

    model_config = _FROZEN
    kind: Literal["lru"]


class S3FIFOConfig(BaseModel):
    """S3-FIFO (SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO."""

    model_config = _FROZEN
    kind: Literal["s3fifo"]
    small_ratio: float = Field(default=0.1, gt=0, lt=1)
    ghost_ratio: float = Field(default=0.9, gt=0, le=4)
    promote_min_freq: int = Field(default=1, ge=0, le=3)  # touches in S that earn a place in M


class ARCConfig(BaseModel):
    """Adaptive replacement cache (Megiddo and Modha, FAST'03)."""

    model_config = _FROZEN
    kind: Literal["arc"]


class BeladyConfig(BaseModel):
    """The offline optimum (evict the block reused furthest in the future); replay only."""

    model_config = _FROZEN
    kind: Literal["belady"]


class AgenticConfig(BaseModel):
    """Session-aware eviction: keep a live session hot until its next turn is unlikely.

    `idle_quantile` (YAML also `idle_demote_after: p90_gap`): a session idle past this
    quantile of its gap distribution is offered for demotion. `rank`: evict the lowest hit
    density first (`density`, over holding times from `density_min_s` to `density_max_s`)
    or the furthest predicted read (`next_use`, its `next_use_quantile`).
    `prefetch_quantile`: a demoted session is brought back once its next turn has come with
    this probability, less the time to restore it. `prior_gap_s` seeds the session tracker's
    gap prior.
    """

    model_config = _FROZEN
    kind: Literal["agentic"]
    idle_quantile: float = Field(default=0.9, gt=0, lt=1, alias="idle_demote_after")
    prefetch: bool = True
    prefetch_quantile: float = Field(default=0.2, gt=0, lt=1)
    shared_min_sessions: int = Field(default=2, ge=2)
    prior_gap_s: float = Field(default=5.0, gt=0)
    refresh_s: float = Field(default=5.0, gt=0)    # re-rank every unit (idle times grow)
    resnap_s: float = Field(default=60.0, gt=0)    # re-read every session's prediction
    rank: Literal["density", "next_use"] = "density"
    density_min_s: float = Field(default=0.25, gt=0)
    density_max_s: float = Field(default=3600.0, gt=0)
    next_use_quantile: float = Field(default=0.5, gt=0, lt=1)
    select: bool = False   # follow the candidate whose miniature simulation hits the most
    select_candidates: tuple[str, ...] = ("agentic", "lru", "s3fifo", "arc")
    # each shadow holds about this many blocks: the share of sessions simulated is this over
    # the tier's capacity (at most 1), so shadow state and work stay the same on any tier size
    select_shadow_blocks: int = Field(default=8192, ge=1)
    select_sample_rate: float = Field(default=0.0, ge=0, le=1)  # a floor on that share
    select_window: int = Field(default=512, ge=8)       # sampled lookups the scores decay over
    # a leader must beat the current by this share of the bytes looked up (0.005: half a point)
    select_margin: float = Field(default=0.005, ge=0, le=1)

    @field_validator("select_candidates")
    @classmethod
    def _candidates(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [c for c in v if c not in ("agentic", "lru", "s3fifo", "arc")]
        if bad or not v:
            raise ValueError(f"select_candidates: expected some of agentic, lru, s3fifo, arc, "
                             f"got {', '.join(bad) or 'none'}")
        return v

    @field_validator("idle_quantile", mode="before")
    @classmethod
    def _gap_quantile(cls, v: object) -> object:
        # `p90_gap` reads as the 0.9 quantile of the session's gap distribution
        if isinstance(v, str) and re.fullmatch(r"p\d{1,2}(\.\d+)?_gap", v):
            return float(v[1:-4]) / 100
        return v


EVICTION_KINDS: dict[str, type[BaseModel]] = {
    "lru": LRUConfig,
    "s3fifo": S3FIFOConfig,
    "arc": ARCConfig,
    "belady": BeladyConfig,
    "agentic": AgenticConfig,
}
EvictionConfig = Annotated[Union[tuple(EVICTION_KINDS.values())], Field(discriminator="kind")]


class ReuseAdmissionConfig(BaseModel):
    """Admit to the capacity tiers what is likely reused, within a write budget per tier."""

    model_config = _FROZEN
    kind: Literal["reuse"]
    nvme_write_budget_bps: Rate | None = Field(default=None, alias="nvme_write_budget")
    sharedfs_write_budget_bps: Rate | None = Field(default=None, alias="sharedfs_write_budget")
    burst_s: float = Field(default=600.0, gt=0)
    min_reuse_probability: float = Field(default=0.05, ge=0, le=1)


class AlwaysAdmissionConfig(BaseModel):
    """Admit every block (a baseline)."""

    model_config = _FROZEN
    kind: Literal["always"]


ADMISSION_KINDS: dict[str, type[BaseModel]] = {
    "reuse": ReuseAdmissionConfig,
    "always": AlwaysAdmissionConfig,
}
AdmissionConfig = Annotated[Union[tuple(ADMISSION_KINDS.values())], Field(discriminator="kind")]
