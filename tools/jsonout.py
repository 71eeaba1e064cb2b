"""Reports as JSON: the plain form every report takes before `json.dump`."""

from __future__ import annotations

from pathlib import Path


def plain(x):
    """`x` with paths as strings and tuples as lists (JSON-ready)."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return str(x) if isinstance(x, Path) else x
