"""Compile a workload into segments: the units the replay simulator hands to policies.

Replaying tens of millions of block lookups one by one through Python policies would take
hours. But requests share prefixes in long runs: a turn re-reads its session's whole chain
and appends a few thousand tokens. So the blocks form a trie of chains, and a run of blocks
with no branch and no request ending inside it is always read, hit or missed as a whole.
Such runs (radix-tree edges, cut every `max_segment_blocks` blocks so eviction stays fine
grained) become one key each, with a size. Every request covers a whole number of segments,
so hits counted on segments equal hits counted on blocks, under prefix semantics.

The compiled trace also carries, for the offline oracle only, the index of the next request
that reads each (request, segment) occurrence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.tools.workload.traces import Workload


@dataclass
class Compiled:
    work: Workload
    seg: np.ndarray          # int64 flat segment ids per request (chain order)
    seg_off: np.ndarray      # int64 offsets into `seg`, len(requests) + 1
    seg_blocks: np.ndarray   # int64 blocks per segment
    cum_blocks: np.ndarray   # int64 flat: blocks covered up to and including each occurrence
    next_req: np.ndarray     # int64 flat: next request reading the same segment (n if never)
    next_same: np.ndarray    # float64 per request: next arrival of the same true session

    @property
    def n_segments(self) -> int:
        return len(self.seg_blocks)

    @property
    def footprint_blocks(self) -> int:
        return int(self.seg_blocks.sum())


def compile_workload(work: Workload, max_segment_blocks: int = 64) -> Compiled:
    blocks, offsets = work.blocks, work.offsets
    n_req, n_flat = len(work), len(blocks)
    n_ids = int(blocks.max()) + 1 if n_flat else 0
    req_of = np.repeat(np.arange(n_req), np.diff(offsets))
    depth = np.arange(n_flat) - offsets[req_of]
    first = depth == 0
    parent = np.where(first, -1, np.roll(blocks, 1))
    # distinct children per block, and blocks where some request ends
    edges = np.unique(parent[~first] * n_ids + blocks[~first]) if n_flat else parent[:0]
    children = np.bincount(edges // max(n_ids, 1), minlength=n_ids)
    ends = np.zeros(n_ids, dtype=bool)
    nonempty = np.diff(offsets) > 0
    ends[blocks[offsets[1:][nonempty] - 1]] = True
    depth_of = np.zeros(n_ids, dtype=np.int64)
    depth_of[blocks] = depth
    brk = ends | (children != 1) | ((depth_of + 1) % max_segment_blocks == 0)
    starts = first.copy()
    starts[~first] = brk[parent[~first]]
    pos = np.flatnonzero(starts)
    # a segment occurrence runs from its start to the next start or the end of its chain
    stop = np.append(pos[1:], n_flat)
    chain_end = offsets[req_of[pos] + 1]
    length = np.minimum(stop, chain_end) - pos
    seg_raw = blocks[pos]
    uniq, seg = np.unique(seg_raw, return_inverse=True)
    seg = seg.ravel().astype(np.int64)
    seg_blocks = np.zeros(len(uniq), dtype=np.int64)
    seg_blocks[seg] = length
    seg_req = req_of[pos]
    seg_off = np.zeros(n_req + 1, dtype=np.int64)
    np.cumsum(np.bincount(seg_req, minlength=n_req), out=seg_off[1:])
    cum = np.cumsum(length)
    head = np.minimum(seg_off[:-1], max(len(pos) - 1, 0))
    cum_blocks = cum - np.repeat(cum[head] - length[head], np.diff(seg_off)) if len(pos) else cum
    return Compiled(work, seg, seg_off, seg_blocks, cum_blocks,
                    _next_request(seg, seg_req, n_req), _next_same(work))


def _next_request(seg: np.ndarray, seg_req: np.ndarray, n_req: int) -> np.ndarray:
    order = np.lexsort((seg_req, seg))
    nxt = np.full(len(seg), n_req, dtype=np.int64)
    same = seg[order[1:]] == seg[order[:-1]]
    nxt[order[:-1][same]] = seg_req[order[1:][same]]
    return nxt


def _next_same(work: Workload) -> np.ndarray:
    """Per request, the arrival of the next request of the same true session (inf if none
    or unknown): a turn's blocks cannot be saved after its own next turn arrived."""
    out = np.full(len(work), np.inf)
    known = np.flatnonzero(work.session >= 0)
    if len(known):
        order = known[np.lexsort((work.arrival_s[known], work.session[known]))]
        same = work.session[order[1:]] == work.session[order[:-1]]
        out[order[:-1][same]] = work.arrival_s[order[1:][same]]
    return out
