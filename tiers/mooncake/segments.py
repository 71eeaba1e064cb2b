"""Pool segments lent from files, and reading other processes' blocks straight out of them.

With `segment_dir` set on a mooncake tier, each embedded client lends its segment from a file
in that directory (a tmpfs such as /dev/shm) through Mooncake's `mount_segment`, instead of
private memory. Mooncake maps the file shared, so the bytes of every object put in that
segment are in the file. Another kvtier process of the node asks the master where a block
lies (`batch_get_replica_desc`: the lending client's transport endpoint and the address in
its mapping, under a lease, so the master neither evicts nor moves it meanwhile), maps the
same file read-only and copies the frame out: no transfer engine, no CPU of the lender. A
caller that can read frames where they lie (the connector's CPU scatter) takes runs of them
from `MooncakeTier.locate` instead, and has its checksums of what it used checked after.

Names: `kvtier-seg-<host>_<port>-<base hex>-<pid>.mem`, where `<host>:<port>` is the lender's
transport endpoint (what replica descriptors name) and `<base>` the address of its mapping
in the lender (a block lies at `buffer_address - base`). The lender learns its endpoint from
a probe object it puts in its own segment right after the mount.

A reader maps each lender's file once and keeps the mapping; an engine maps those of the
lenders already there when it opens the tier, so its first hit from each does not wait for
it. A page read for the first time through a mapping costs a page fault (a fresh 16 MiB
read took ~10 ms against ~2 once mapped), so a thread maps every page of a new mapping
right away, in the background (`MADV_POPULATE_READ`, Linux 5.14+; older kernels fault
pages in as they are read). This costs the reader page tables of ~2 MiB per GiB of segment,
and ~0.1 s of CPU per GiB, once: the lender has zeroed its file's pages itself as it
started (`LentFile.fill`; a reader that maps them first zeroes them, ~0.6 s per GiB).

Files belong to their lender's life: it unlinks its file at close; a file whose lender died
(a crash) is removed by the next lender of the node that starts (`sweep`). The whole size is
allocated up front (`posix_fallocate`), so a tmpfs too small for `capacity` is an error at
start, never a SIGBUS when the pool fills. Readers check each frame as the transfer path
does; a frame that fails is read again through Mooncake, never quarantined from here.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import threading
import time
from pathlib import Path

import numpy as np

from kvtier.store.base.block import populate
from kvtier.store.base.errors import TierUnavailableError
from kvtier.store.base.index_record import owner_alive
from kvtier.store.base.priority import deprioritize
from kvtier.tiers.mooncake.hostname import host_of

PREFIX = "kvtier-seg-"
_NAME = re.compile(r"^kvtier-seg-(.+)_(\d+)-([0-9a-f]+)-(\d+)\.mem$")
POPULATE_PIECE = 64 << 20  # a closing mapping stops its population between pieces
RESCAN_S = 1.0  # an unknown endpoint makes a reader list the directory at most this often
REFRESH_S = 10.0  # and mappings of files gone (lenders that stopped) are dropped this often


def file_name(endpoint: str, base: int, pid: int) -> str:
    host, port = endpoint.rsplit(":", 1)
    return f"{PREFIX}{host}_{port}-{base:x}-{pid}.mem"


def parse_name(name: str) -> tuple[str, int, int] | None:
    """(endpoint, base, pid) of a segment file's name, or None for any other file."""
    m = _NAME.match(name)
    if m is None:
        return None
    return f"{m.group(1)}:{m.group(2)}", int(m.group(3), 16), int(m.group(4))


def sweep(directory: Path) -> int:
    """Remove segment files whose lender is gone (a pid reused since counts as gone: the
    process holding it started after the file was written); returns how many."""
    n = 0
    for path in directory.glob(PREFIX + "*"):
        parsed = parse_name(path.name)
        pid = parsed[2] if parsed else _tmp_pid(path.name)
        if pid is None:
            continue
        try:
            if not owner_alive(pid, path.stat().st_mtime):
                path.unlink()
                n += 1
        except FileNotFoundError:
            pass
    return n


def _tmp_pid(name: str) -> int | None:
    """The pid of a file still under its first name (`kvtier-seg-new-<pid>-<token>.mem`)."""
    m = re.match(r"^kvtier-seg-new-(\d+)-[0-9a-f]+\.mem$", name)
    return int(m.group(1)) if m else None


class LentFile:
    """The file a client lends its segment from: made and allocated in full here, renamed by
    `publish` once Mooncake has mounted it, removed by `remove` after the client closed.

    Allocated is not written: tmpfs zeroes a page at its first fault, whoever takes it (the
    lender's first put there, or a reader mapping the file in), ~0.6 s of CPU per GiB on an
    AMD VM. `fill` zeroes them all on a thread of the lender's, once, while it starts, so
    that neither a save nor a reader's first hit pays for it."""

    def __init__(self, directory: str | os.PathLike[str], size: int, tier: str):
        self.dir = Path(directory)
        self.size = size
        self._filler: threading.Thread | None = None
        self._stop_fill = threading.Event()
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise TierUnavailableError(f"tier {tier!r}: cannot use segment_dir {self.dir} "
                                       f"({e.strerror}); point it at a writable tmpfs "
                                       "such as /dev/shm") from None
        sweep(self.dir)
        self.path = self.dir / f"{PREFIX}new-{os.getpid()}-{secrets.token_hex(4)}.mem"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            free = os.statvfs(self.dir)
            raise TierUnavailableError(
                f"tier {tier!r}: segment_dir {self.dir} cannot hold a {size >> 20} MiB "
                f"segment ({e.strerror}; {free.f_bavail * free.f_frsize >> 20} MiB free); "
                "grow the tmpfs (docker run --shm-size) or lower capacity") from None
        os.close(fd)

    def base(self) -> int:
        """Where this process maps the file (after Mooncake's `mount_segment`)."""
        name = str(self.path)
        with open("/proc/self/maps") as maps:
            for line in maps:
                if line.rstrip().endswith(name):
                    return int(line.split("-", 1)[0], 16)
        raise TierUnavailableError(f"segment file {name} is not mapped after the mount")

    def fill(self, base: int) -> None:
        """Map in every page of this process's mapping of the file at `base` (Mooncake's,
        read and write) on a thread; `stop_fill` ends it before the mapping goes."""
        self._filler = threading.Thread(target=self._fill, args=(base, self._stop_fill),
                                        name="kvtier-seg-fill", daemon=True)
        self._filler.start()

    def _fill(self, base: int, stop: threading.Event) -> None:
        # a prefill meanwhile goes first; a save zeroes what it reaches first
        _populate_in_pieces(base, self.size, True, stop)

    def stop_fill(self) -> None:
        """End `fill`'s thread (within one piece) before the client unmaps the file."""
        if self._filler is not None:
            self._stop_fill.set()
            self._filler.join()

    def publish(self, endpoint: str, base: int) -> None:
        """Rename the file so readers find it by the endpoint replica descriptors name."""
        final = self.dir / file_name(endpoint, base, os.getpid())
        os.rename(self.path, final)
        self.path = final

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


class Segments:
    """The segment files of this node's lenders, mapped read-only on first use, or all at
    once by `map_all` (an engine's tier, when it opens). Thread-safe.

    Only lenders that announce this host (`host`, the reader's own announced address) are
    read from files: `segment_dir` may be a directory several hosts see (a shared /dev/shm
    of containers, network namespaces on one machine), and another host's file there holds
    no bytes this host may rely on (that host's lender may be cut off or gone). Other hosts
    go through the transfer engine.

    A mapping keeps its file's memory alive after the file is unlinked: the directory is
    listed again every `REFRESH_S` (and at most every `RESCAN_S` for an endpoint not seen
    yet), and mappings whose file is gone or renamed are dropped then."""

    def __init__(self, directory: str | os.PathLike[str], host: str | None):
        self.dir = Path(directory)
        self.host = host
        self.mapped = 0  # mappings made (tests: a host never maps another host's file)
        self._lock = threading.Lock()
        self._maps: dict[str, _Mapped] = {}
        self._names: dict[str, str] = {}  # endpoint -> file name, from the last listing
        self._listed = 0.0

    def view(self, endpoint: str) -> tuple[memoryview, int] | None:
        """(the segment's bytes, its base in the lender) or None if not on this node."""
        if self.host is None or host_of(endpoint) != self.host:
            return None
        if time.monotonic() - self._listed >= REFRESH_S:
            with self._lock:
                self._list()
        got = self._maps.get(endpoint)
        if got is not None:
            return got.view, got.base
        with self._lock:
            got = self._maps.get(endpoint)
            if got is None:
                if endpoint not in self._names and time.monotonic() - self._listed >= RESCAN_S:
                    self._list()
                name = self._names.get(endpoint)
                got = self._keep(endpoint, name) if name is not None else None
                if got is None:
                    return None
            return got.view, got.base

    def map_all(self) -> int:
        """Map the files of every lender of this host now (their pages are mapped in by
        background threads), so that the first read from each does not pay for the mapping;
        returns how many it mapped. A lender that starts later is mapped at its first read."""
        if self.host is None:
            return 0
        with self._lock:
            self._list()
            return sum(self._keep(endpoint, name) is not None
                       for endpoint, name in self._names.items()
                       if endpoint not in self._maps and host_of(endpoint) == self.host)

    def _keep(self, endpoint: str, name: str) -> _Mapped | None:
        """Map `name`, the file of `endpoint`, and keep the mapping (None: the file is gone).
        Lock held."""
        got = self._map(name)
        if got is not None:
            self.mapped += 1
            self._maps[endpoint] = got
        return got

    def hosts(self) -> set[str]:
        """The hosts of the lenders whose files are mapped now."""
        with self._lock:
            return {host_of(endpoint) for endpoint in self._maps}

    def recheck(self) -> None:
        """A mapping served a bad frame: list the directory at the next read, which drops
        the mapping if its lender's file is gone or renamed (a stale mapping). A frame that
        was only overwritten meanwhile (evicted, its space reused) keeps the mapping, and
        its pages: mapping them again costs ~0.4 s of CPU per GiB."""
        with self._lock:
            self._listed = 0.0

    def _list(self) -> None:
        """List the directory; drop mappings whose file is gone or renamed. Lock held."""
        self._listed = time.monotonic()
        try:
            entries = os.listdir(self.dir)
        except OSError:
            entries = []
        self._names = {}
        for name in entries:
            parsed = parse_name(name)
            if parsed is not None:
                self._names[parsed[0]] = name
        for endpoint in [e for e, m in self._maps.items() if self._names.get(e) != m.name]:
            self._maps.pop(endpoint).close()

    def _map(self, name: str) -> _Mapped | None:
        try:
            fd = os.open(self.dir / name, os.O_RDONLY)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EACCES):
                return None
            raise
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return _Mapped(name, parse_name(name)[1], mm)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for got in maps.values():
            got.close()


class _Mapped:
    """One lender's file, mapped read-only; its pages are mapped in the background."""

    def __init__(self, name: str, base: int, mm: mmap.mmap):
        self.name, self.base, self.mm = name, base, mm
        self.view = memoryview(mm)
        self._closing = threading.Event()
        self.populated = threading.Event()  # set when done, or given up
        threading.Thread(target=self._populate, name="kvtier-seg-populate", daemon=True).start()

    def _populate(self) -> None:
        # The array holds the mapping open until this ends (close then leaves it to GC).
        arr = np.frombuffer(self.mm, dtype=np.uint8)
        try:  # a read meanwhile faults in what it needs itself
            _populate_in_pieces(arr.ctypes.data, arr.size, False, self._closing)
        finally:
            del arr
            self.populated.set()

    def close(self) -> None:
        self._closing.set()
        try:
            self.view.release()
            self.mm.close()
        except BufferError:  # a read or the population still uses it: it goes with the last
            # reference
            pass


def _populate_in_pieces(addr: int, size: int, write: bool, stop: threading.Event) -> None:
    """Map in [addr, addr + size) a piece at a time, at the least CPU priority, until done,
    `stop` is set (checked between pieces) or the kernel cannot (before 5.14: pages are
    then mapped in as they are first touched)."""
    deprioritize()
    for off in range(0, size, POPULATE_PIECE):
        if stop.is_set() or not populate(addr + off, min(POPULATE_PIECE, size - off),
                                         write=write):
            return
