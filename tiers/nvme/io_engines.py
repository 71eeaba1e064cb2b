"""Batched positional I/O engines for the nvme tier: `uring` (io_uring) and `psync` (preadv).

An engine runs a batch of `IOOp`s (fd, buffer, offset, read or write) and returns, per op, the
number of bytes moved or `-errno`. It never raises for an I/O error of one op: the caller
decides what a failed op means (a miss for reads, an abort for writes, ENOSPC a full tier).

The caller guarantees: buffers stay alive and are not touched until `run` returns; with
O_DIRECT, buffers, offsets and lengths are multiples of 4 KiB. Engines MUST be safe for
concurrent `run` calls from several threads, and usable again in a child process after fork
(each process builds its own kernel objects).

`psync` is the reference: one blocking `preadv`/`pwritev` at a time, queue depth 1, no
dependencies. `uring` (in `tiers.nvme.uring`) keeps `queue_depth` ops in flight on one ring.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Sequence

from kvtier.store.base.errors import ConfigError


@dataclass(frozen=True)
class IOOp:
    fd: int
    buf: memoryview
    offset: int
    write: bool


class IOEngine:
    """Runs batches of positional I/O; see the module docstring for the contract."""

    name = ""

    def run(self, ops: Sequence[IOOp]) -> list[int]:
        raise NotImplementedError

    def close(self) -> None:
        """Release kernel objects. Idempotent."""


class PsyncEngine(IOEngine):
    """One blocking syscall per op (releases the GIL, so threads still overlap)."""

    name = "psync"

    def __init__(self, queue_depth: int = 1):
        self.queue_depth = 1

    def run(self, ops: Sequence[IOOp]) -> list[int]:
        return [self._one(op) for op in ops]

    @staticmethod
    def _one(op: IOOp) -> int:
        done, want = 0, len(op.buf)
        try:
            # Loop over short transfers: a regular file returns short only at EOF (reads) or
            # when the disk fills (writes), which the next call then reports as an errno.
            while done < want:
                view = op.buf[done:]
                n = (os.pwritev(op.fd, [view], op.offset + done) if op.write
                     else os.preadv(op.fd, [view], op.offset + done))
                if n == 0:
                    break
                done += n
        except OSError as e:
            return -(e.errno or 5)
        return done


# engine name -> (module, factory); the uring module imports liburing lazily, and falls
# back to psync where the bindings would crash the process (`uring.open_engine`).
ENGINES: dict[str, tuple[str, str]] = {
    "psync": ("kvtier.tiers.nvme.io_engines", "PsyncEngine"),
    "uring": ("kvtier.tiers.nvme.uring", "open_engine"),
}


def make_engine(name: str, queue_depth: int) -> IOEngine:
    """Build the engine `io.engine` names."""
    if name not in ENGINES:
        raise ConfigError(f"unknown io.engine {name!r}; use one of {', '.join(sorted(ENGINES))}")
    module, cls = ENGINES[name]
    return getattr(importlib.import_module(module), cls)(queue_depth)
