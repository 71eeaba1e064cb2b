"""The connector's configuration: `kv_connector_extra_config`, validated once.

Fields (all optional; unknown ones are errors):
- `kvtier_config`: path of a policy YAML file; or
- `policy`: the policy inline, as a mapping (same schema as the file). With neither, the
  embedded default policy (one machine, embedded master) is used; with both, an error.
- `node_id`: this instance's node name in the index (default: the host name).
- `staging_buffer`: bytes of one staging buffer (default 64MiB; a batch of chunks moves
  through one buffer), `staging_buffers`: how many may be in flight for saves (default 4;
  more saves wait for one, up to a second: saves stuck longer, behind a tier that hangs,
  are dropped and counted until one frees, so the engine never waits on them).
- `load`: when a hit is loaded. `async` (default): in the background while the engine runs
  other requests; the request joins the next step once its load is done. `sync`: within
  the step that schedules the request, before its forward (no step in between, but every
  request of that step waits for the load). `auto`: `sync` when the engine runs no other
  request, else `async`. Measured side by side, neither made a lone remote hit faster
  (BENCHMARKS.md).
- `tool_call_token_ids`: `auto` (default: the known tool-call tokens the model's tokenizer
  holds, see tool_calls.py), or a list of token ids; a turn whose output holds one waits
  for a tool. An empty list: every turn is one gap class.
- `load_deadline` (default true): load only the part of a hit that beats recomputing it,
  and give up on what has not arrived by the time waiting would cost more than it saves
  (`connector/plan/recompute.py`); false loads every hit whatever it takes.
- `prefill_tokens_per_s` (default 2000): the engine's prefill rate until it has timed its
  own steps (a few seconds of serving); a guess on the slow side only lengthens deadlines.

Every mistake raises `ConfigError` with one line naming the field and the fix. Nothing is
read from environment variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kvtier.store.base.config import Policy, load_policy, policy_from_dict
from kvtier.store.base.config_errors import format_validation_error
from kvtier.store.base.errors import ConfigError
from kvtier.store.base.units import parse_size

SOURCE = "kv_connector_extra_config"


def _token_ids(v: Any) -> str | tuple[int, ...]:
    ok = v == "auto" or isinstance(v, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
    if not ok:
        raise ValueError(f"expected 'auto' or a list of token ids >= 0 (such as [151657]), "
                         f"got {v!r}")
    return v if v == "auto" else tuple(v)


class _ExtraConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    kvtier_config: Path | None = None
    policy: dict[str, Any] | None = None
    node_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    staging_buffer_bytes: Annotated[int, BeforeValidator(parse_size)] = Field(
        default=64 << 20, alias="staging_buffer", ge=1 << 20)
    staging_buffers: int = Field(default=4, ge=1, le=256)
    load: Literal["auto", "async", "sync"] = "async"
    tool_call_token_ids: Annotated[Any, BeforeValidator(_token_ids)] = "auto"
    load_deadline: bool = True
    prefill_tokens_per_s: float = Field(default=2000.0, gt=0)


@dataclass(frozen=True)
class ConnectorConfig:
    policy: Policy
    node_id: str | None
    staging_buffer_bytes: int
    staging_buffers: int
    load: str = "async"
    # an output holding one ended on a tool call; "auto": the tokenizer's (tool_calls.py)
    tool_call_token_ids: tuple[int, ...] | Literal["auto"] = "auto"
    # plan each hit (load what beats recomputing it) and give its load a deadline
    load_deadline: bool = True
    # the engine's prefill rate until it has timed its own steps (a slow guess is safe)
    prefill_tokens_per_s: float = 2000.0


def parse_extra_config(extra: Any) -> ConnectorConfig:
    """Validate `kv_connector_extra_config` and load the policy it names."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{SOURCE}: expected a mapping, got {type(extra).__name__}")
    try:
        cfg = _ExtraConfig.model_validate(extra)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, SOURCE, _ExtraConfig)) from None
    if cfg.kvtier_config is not None and cfg.policy is not None:
        raise ConfigError(f"{SOURCE}: kvtier_config and policy are both set; give the policy "
                          "as a file path (kvtier_config) or inline (policy), not both")
    if cfg.policy is not None:
        policy = policy_from_dict(cfg.policy, source=f"{SOURCE}.policy")
    else:
        policy = load_policy(_policy_file(cfg.kvtier_config))
    return ConnectorConfig(policy, cfg.node_id, cfg.staging_buffer_bytes, cfg.staging_buffers,
                           cfg.load, cfg.tool_call_token_ids, cfg.load_deadline,
                           cfg.prefill_tokens_per_s)


def _policy_file(path: Path | None) -> Path | None:
    """`kvtier_config`, checked: a path that is no readable file is this field's fault."""
    if path is None or path.is_file():
        return path
    what = "a directory, not a policy file" if path.is_dir() else \
        f"no such policy file (looked at {path.absolute()})"
    raise ConfigError(f"{SOURCE}: kvtier_config: {path}: {what}; point kvtier_config at a "
                      "policy YAML file, or omit it for the default policy")
