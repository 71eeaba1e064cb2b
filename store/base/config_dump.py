"""A policy as its user writes it: the keys of the YAML file, sizes and rates in units.

`policy_as_written(policy)` is what `kvtier config show` prints: the field names a policy file
uses (`capacity`, `map_size`, `idle_demote_after`), every default filled in, paths absolute,
sizes as `512MiB` where a unit divides them exactly, rates as `2TiB/day`, modes as `0o600`.
Loading what it prints gives the same policy back. With `human=False` sizes and rates stay
numbers (bytes, bytes per second) under the same keys, for scripts.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

_IEC = (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20),
        ("KiB", 1 << 10))
_PERIODS = (("day", 86400), ("h", 3600), ("s", 1))


def size_as_written(n: int) -> str | int:
    """`n` bytes in the largest IEC unit that divides it (`512MiB`), else the bytes."""
    for unit, size in _IEC:
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return n


def rate_as_written(bps: float) -> str | float:
    """Bytes per second as `SIZE/PERIOD` where that is exact (`2TiB/day`), else bytes/s."""
    for period, seconds in _PERIODS:
        total = bps * seconds
        whole = round(total)
        if whole and math.isclose(total, whole, rel_tol=1e-9):
            size = size_as_written(whole)
            if isinstance(size, str):
                return f"{size}/{period}"
    return bps


def policy_as_written(policy: BaseModel, human: bool = True) -> dict[str, Any]:
    """The policy as plain data under its file's keys (see the module docstring)."""
    return _model(policy, human)


def _model(model: BaseModel, human: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        if field.exclude:
            continue
        out[field.alias or name] = _value(name, getattr(model, name), human)
    return out


def _value(name: str, value: Any, human: bool) -> Any:
    if isinstance(value, BaseModel):
        return _model(value, human)
    if isinstance(value, list):
        return [_value(name, v, human) for v in value]
    if isinstance(value, dict):
        return {k: _value(name, v, human) for k, v in value.items()}
    if value is None or isinstance(value, bool):
        return value
    if name == "file_mode":
        return f"0o{value:o}"
    if human and name.endswith("_bytes"):
        return size_as_written(value)
    if human and name.endswith("_bps"):
        return rate_as_written(value)
    if human and name == "idle_quantile" and float(value * 100).is_integer():
        return f"p{int(value * 100)}_gap"
    if hasattr(value, "__fspath__"):
        return str(value)
    return value
