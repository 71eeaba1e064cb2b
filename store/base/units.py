"""Parsing of human sizes (`512MiB`, `4TiB`, `1.5GB`) and rates (`2TiB/day`) into numbers."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
_PERIODS_S = {"s": 1, "sec": 1, "second": 1, "min": 60, "minute": 60, "h": 3600, "hour": 3600,
              "d": 86400, "day": 86400, "w": 604800, "week": 604800}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")

SIZE_HINT = "a size like '512MiB', '4TiB' or a whole number of bytes"
RATE_HINT = "a rate like '2TiB/day', '100MiB/s' or '500GB/h'"


def parse_size(value: object) -> int:
    """Return `value` in bytes; accepts ints and strings with SI or IEC units.

    Raises ValueError with a message that says what was expected.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected {SIZE_HINT}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected {SIZE_HINT}, got negative {value}")
        return value
    if isinstance(value, float) and value >= 0 and value.is_integer():
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected {SIZE_HINT}, got {value!r}")
    m = _SIZE_RE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"expected {SIZE_HINT}, got {value!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_rate(value: object) -> float:
    """Return `value` in bytes per second; accepts `SIZE/PERIOD` strings or a number of B/s."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    if not isinstance(value, str) or value.count("/") != 1:
        raise ValueError(f"expected {RATE_HINT}, got {value!r}")
    size_s, period = (part.strip().lower() for part in value.split("/"))
    if period not in _PERIODS_S:
        raise ValueError(f"expected {RATE_HINT}, got {value!r}")
    try:
        size = parse_size(size_s)
    except ValueError:
        raise ValueError(f"expected {RATE_HINT}, got {value!r}") from None
    return size / _PERIODS_S[period]


def format_size(n: float) -> str:
    """Render a byte count with an IEC unit, e.g. `1.5GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}PiB"
