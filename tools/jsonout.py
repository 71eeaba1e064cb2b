"""Reports as JSON: the plain form every report takes before `json.dump`."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def plain(x):
    """`x` with paths as strings and tuples as lists (JSON-ready)."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return str(x) if isinstance(x, Path) else x


def write_report(doc: dict, path: Path) -> None:
    """Write `doc` to `path` as JSON, with the command line that made it (`command`)."""
    doc["command"] = "kvtier " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plain(doc), indent=2))
