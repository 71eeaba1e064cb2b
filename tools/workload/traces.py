"""Trace loaders: every source becomes one `Workload`, the replay harness's only input.

A workload is a list of requests sorted by arrival, each with the chain of its block ids
(dense ints in one global namespace, head first; equal ids mean equal prefixes), its input
and output token counts, its true session (-1 when the trace has none), its service time
(arrival to response end, as recorded; 0 when unknown) and the class of the wait after it
(`GAP_CLASSES`: what a server knows when the response ends, e.g. that the model stopped on a
tool call). Chains are stored flat (`blocks[offsets[i]:offsets[i+1]]`).

Loaders are fuzz-safe: malformed input raises `TraceError` with a one-line message naming
the file, the line or request, and the field; never a traceback from deep inside.
Sources (see ../shared/traces/SOURCES.md):
- `load_weka(dir)`: Claude Code sessions, one JSON(.gz) per session, 64-token blocks with
  session-local ids (namespaced per file); sub-agent requests are flattened at absolute time
  (container `t` + nested `t`); sessions are started in `live` slots (a seeded order), so
  about `live` are in progress at once. `chunk_tokens` (a multiple of 64) coarsens the
  blocks the way a store with that chunk size sees them.
- `load_mooncake(path)`: the FAST'25 conversation trace, JSON lines, ms timestamps,
  512-token blocks, no sessions. Its trailing partial block is dropped: a store saves full
  blocks only (and with it, a continuation is a pure extension of the chain before it).
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.store.base.errors import KVTierError

GAP_CLASSES = (None, "tool", "user")   # code 0, 1, 2 in `Workload.gap_class`
# where each trace-backed workload lies under the traces folder (`--traces`)
TRACE_FILES = {"weka": "weka_cc_traces", "conversation": "conversation_trace.jsonl"}
_WEKA_STOP = {"tool_use": "tool", "end_turn": "user"}


class TraceError(KVTierError):
    """A trace file is missing or malformed; the message names where and what."""


@dataclass
class Workload:
    name: str
    block_tokens: int
    arrival_s: np.ndarray      # float64, non-decreasing
    input_tokens: np.ndarray   # int64
    output_tokens: np.ndarray  # int64
    session: np.ndarray        # int64 true session id, -1 when unknown
    gap_class: np.ndarray      # int8 index into GAP_CLASSES
    service_s: np.ndarray      # float64 arrival -> response end (0: unknown)
    blocks: np.ndarray         # int64 flat chains
    offsets: np.ndarray        # int64, len(requests) + 1
    gap_names: tuple = GAP_CLASSES  # what each `gap_class` code stands for

    def __len__(self) -> int:
        return len(self.arrival_s)

    def chain(self, i: int) -> np.ndarray:
        return self.blocks[self.offsets[i]:self.offsets[i + 1]]

    @property
    def unique_blocks(self) -> int:
        return int(np.unique(self.blocks).size)

    @property
    def footprint_tokens(self) -> int:
        """Tokens of every distinct block: what an infinite cache ends up holding."""
        return self.unique_blocks * self.block_tokens


def build(name: str, block_tokens: int, rows: list[tuple], chains: list[np.ndarray]) -> Workload:
    """Assemble a workload from per-request rows (arrival_s, in, out, session, gap_class,
    service_s) and chains of raw ids; sorts by arrival (stable) and densifies the ids."""
    if not rows:
        raise TraceError(f"{name}: the trace has no requests")
    arr = np.array(rows, dtype=np.float64).reshape(len(rows), 6)
    order = np.argsort(arr[:, 0], kind="stable")
    chains = [chains[i] for i in order]
    lengths = np.fromiter((len(c) for c in chains), dtype=np.int64, count=len(chains))
    offsets = np.zeros(len(chains) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(chains) if len(chains) else np.zeros(0, np.int64)
    _, dense = np.unique(flat, return_inverse=True)
    arr = arr[order]
    return Workload(name, block_tokens, arr[:, 0].copy(), arr[:, 1].astype(np.int64),
                    arr[:, 2].astype(np.int64), arr[:, 3].astype(np.int64),
                    arr[:, 4].astype(np.int8), arr[:, 5].copy(), dense.astype(np.int64).ravel(),
                    offsets)


# ---- field checks shared by the loaders ----------------------------------------------------
def _num(obj: dict, field: str, where: str, *, minimum: float = 0) -> float:
    v = obj.get(field) if isinstance(obj, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= minimum:
        raise TraceError(f"{where}: field {field!r} must be a number >= {minimum:g}, "
                         f"got {v!r}")
    return float(v)


def _ids(obj: dict, where: str) -> np.ndarray:
    v = obj.get("hash_ids")
    try:
        a = np.array(v) if isinstance(v, list) else None
    except (ValueError, TypeError, OverflowError):  # ragged nesting: not a flat list
        a = None
    if a is None or a.ndim != 1 or (a.size and (a.dtype.kind not in "iu" or a.min() < 0)):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of non-negative integers")
    return a.astype(np.int64)


# ---- Mooncake conversation trace ---------------------------------------------------------
def load_mooncake(path: str | Path, max_requests: int | None = None) -> Workload:
    """The FAST'25 trace: one JSON object per line, `timestamp` in ms, 512-token blocks."""
    path = Path(path)
    rows, chains = [], []
    for lineno, line in enumerate(_read_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object per line")
        t = _num(obj, "timestamp", where) / 1000.0
        n_in = _num(obj, "input_length", where)
        n_out = _num(obj, "output_length", where)
        rows.append((t, n_in, n_out, -1, 0, 0.0))
        ids = _ids(obj, where)
        # the trace hashes a trailing partial block too; a store keeps full blocks only
        chains.append(ids[:int(n_in) // 512])
        if max_requests is not None and len(rows) >= max_requests:
            break
    return build(path.name, 512, rows, chains)


def _read_lines(path: Path):
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", errors="strict") as f:
            yield from f
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read the trace ({type(e).__name__}: {e})") from None


GAP_CLASS_MODES = ("trace", "tool-user", "none")


def restrict_gap_classes(w: Workload, mode: str) -> None:
    """Keep less of what the trace knows about each wait, in place: `trace` all of it,
    `tool-user` only a tool call against a person (what a server learns from the model's
    tool-call tokens), `none` nothing (a server told nothing). `mode`: one of
    `GAP_CLASS_MODES` (the CLI checks it)."""
    if mode == "trace":
        return
    coarse = [0 if n is None or mode == "none" else 1 if str(n).startswith("tool") else 2
              for n in w.gap_names]
    w.gap_class = np.asarray(coarse, dtype=np.int8)[w.gap_class]
    w.gap_names = GAP_CLASSES


# ---- WEKA Claude Code sessions -------------------------------------------------------------
def load_weka(directory: str | Path, chunk_tokens: int = 256, live: int = 32, seed: int = 0,
              max_sessions: int | None = None) -> Workload:
    """Every `trace_*.json[.gz]` of `directory`, one session each, interleaved in `live`
    slots in a seeded order (a slot starts its next session when the previous one ends)."""
    directory = Path(directory)
    files = sorted(directory.glob("trace_*.json*")) if directory.is_dir() else []
    if not files:
        raise TraceError(f"{directory}: no trace_*.json(.gz) files (the WEKA session traces)")
    if chunk_tokens % 64 or chunk_tokens <= 0 or live < 1:
        raise TraceError(f"chunk_tokens must be a positive multiple of 64 and live >= 1, "
                         f"got {chunk_tokens} and {live}")
    order = np.random.default_rng(seed).permutation(len(files))[:max_sessions]
    slots = np.zeros(live)
    rows, chains = [], []
    vocab = {name: code for code, name in enumerate(GAP_CLASSES)}
    for n, i in enumerate(order):
        sess_rows, sess_chains = _weka_session(files[i], int(i), chunk_tokens // 64, vocab)
        slot = int(np.argmin(slots))
        start = slots[slot]
        slots[slot] = start + max(r[0] for r in sess_rows) + 1.0
        rows += [(r[0] + start,) + r[1:] for r in sess_rows]
        chains += sess_chains
    w = build(f"weka({len(order)} sessions, {live} live)", chunk_tokens, rows, chains)
    w.gap_names = tuple(sorted(vocab, key=vocab.get))[:128]
    return w


def _weka_gap_class(req: dict, vocab: dict) -> int:
    """What a server knows about the wait when the response ends: the model stopped on a
    tool call ("tool:...") or handed back to a person ("user"), refined by what it produced
    (a bare call comes back sooner than one after thinking and text)."""
    kind = _WEKA_STOP.get(req.get("stop"))
    if kind is None:
        return 0
    out = req.get("output_types")
    parts = sorted(x for x in out if isinstance(x, str)) if isinstance(out, list) else []
    name = f"{kind}:{'+'.join(parts)}" if kind == "tool" else kind
    return min(vocab.setdefault(name, len(vocab)), 127)


def _weka_doc(path: Path) -> dict:
    """The parsed session file, checked at the top level."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read the trace ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise TraceError(f"{path}: expected an object with a 'requests' list")
    if doc.get("block_size", 64) != 64:
        raise TraceError(f"{path}: field 'block_size' must be 64, got {doc.get('block_size')!r}")
    return doc


def _weka_session(path: Path, file_idx: int, k: int, vocab: dict) -> tuple[list, list]:
    """Rows and namespaced, coarsened chains of one session file (sub-agents flattened)."""
    doc = _weka_doc(path)
    rows, chains = [], []
    ns = file_idx << 40  # ids are session-local: give each file its own namespace
    todo = [(r, 0.0, file_idx * 1024, f"request {j}") for j, r in enumerate(doc["requests"])]
    sub = 0
    while todo:
        req, base, sess, what = todo.pop(0)
        where = f"{path}: {what}"
        if isinstance(req, dict) and req.get("type") == "subagent":
            sub += 1
            if not isinstance(req.get("requests"), list):
                raise TraceError(f"{where}: sub-agent without a 'requests' list")
            t0 = base + _num(req, "t", where)
            todo += [(r, t0, file_idx * 1024 + sub, f"{what}.{j}")
                     for j, r in enumerate(req["requests"])]
            continue
        if not isinstance(req, dict):
            raise TraceError(f"{where}: expected an object")
        t = base + _num(req, "t", where)
        ids = _ids(req, where)
        gap = _weka_gap_class(req, vocab)
        api = req.get("api_time")
        service = float(api) if isinstance(api, (int, float)) and api > 0 else 0.0
        rows.append((t, _num(req, "in", where), _num(req, "out", where), sess, gap, service))
        chains.append(ids[k - 1::k] + ns)
    if not rows:
        raise TraceError(f"{path}: the session has no requests")
    return rows, chains
