"""The stored block: a fixed 64-byte header followed by the payload, in one frame.

Header (little endian): magic `KVTB`, format version, header size, flags, the 8-byte namespace
fingerprint, the 16-byte chain hash of the key, payload length, xxh3-64 of the payload,
8 reserved bytes, and an xxh32 of the 60 bytes before it. A reader that asks for key K accepts
a frame only if the header is intact, names K (namespace and chain), and the payload length
and checksum match: a torn, truncated, flipped, foreign or misplaced block never verifies.

Frames are built in place (`seal`) so the payload is never copied to add a header; tiers move
frames whole. No pickle: the format is fixed binary.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.store.base.errors import CorruptBlockError
from kvtier.store.base.keys import NS_HEX, check_key

MAGIC = b"KVTB"
VERSION = 1
HEADER_SIZE = 64
PAGE = 4096
_BODY = struct.Struct("<4sHHI8s16sQQ8x")  # 60 bytes
_CRC = struct.Struct("<I")
assert _BODY.size + _CRC.size == HEADER_SIZE


@dataclass(frozen=True)
class Header:
    version: int
    flags: int
    namespace: str
    chain: str
    payload_len: int
    checksum: int

    @property
    def key(self) -> str:
        return self.namespace + self.chain

    @property
    def frame_len(self) -> int:
        return HEADER_SIZE + self.payload_len


def frame_size(payload_len: int, align: int = 1) -> int:
    """Bytes a frame of `payload_len` takes, rounded up to `align`."""
    n = HEADER_SIZE + payload_len
    return -(-n // align) * align


def buffer_address(buf) -> int:
    """The address of the first byte of a C-contiguous buffer (read-only is fine)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))  # writable: 4x cheaper
    except TypeError:
        return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def alloc_aligned(nbytes: int) -> memoryview:
    """A zeroed, page-aligned, writable buffer (usable for O_DIRECT and registration)."""
    return memoryview(mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE)))


MADV_POPULATE_READ = 22   # Linux 5.14+; Python's mmap module does not name them
MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int


def populate(addr: int, nbytes: int, write: bool) -> bool:
    """Map in every page of [addr, addr + nbytes) now (for writing, or only reading), so
    the first copy into or out of them does not pay a page fault per page (a fresh 64 MiB
    buffer's first copy took 7-8x its later ones). False where the kernel cannot (before
    5.14): the pages are then mapped in as they are first touched. Through ctypes, which
    lets go of the GIL for the call (Python's own madvise holds it)."""
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    return nbytes <= 0 or _madvise(addr, nbytes, advice) == 0


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def checksum_of(pieces: Iterable[memoryview | bytes]) -> int:
    """`payload_checksum` of the pieces one after another, without joining them."""
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return h.intdigest()


def seal(frame: memoryview | bytearray, key: str, payload_len: int, flags: int = 0) -> Header:
    """Write the header for the payload already at `frame[HEADER_SIZE:]`; return it."""
    check_key(key)
    frame = memoryview(frame)
    if len(frame) < HEADER_SIZE + payload_len:
        raise ValueError(f"frame of {len(frame)} bytes cannot hold a {payload_len}-byte payload")
    checksum = payload_checksum(frame[HEADER_SIZE:HEADER_SIZE + payload_len])
    body = _BODY.pack(MAGIC, VERSION, HEADER_SIZE, flags, bytes.fromhex(key[:NS_HEX]),
                      bytes.fromhex(key[NS_HEX:]), payload_len, checksum)
    frame[:_BODY.size] = body
    frame[_BODY.size:HEADER_SIZE] = _CRC.pack(xxhash.xxh32_intdigest(body))
    return Header(VERSION, flags, key[:NS_HEX], key[NS_HEX:], payload_len, checksum)


def encode(key: str, payload: bytes | memoryview, flags: int = 0) -> bytearray:
    """A new frame holding `payload` (copies it; prefer `seal` on the data path)."""
    frame = bytearray(HEADER_SIZE + len(payload))
    frame[HEADER_SIZE:] = payload
    seal(frame, key, len(payload), flags)
    return frame


def parse_header(buf: memoryview | bytes) -> Header:
    """Decode and check the header alone; raises CorruptBlockError naming what is wrong."""
    if len(buf) < HEADER_SIZE:
        raise CorruptBlockError(f"truncated header ({len(buf)} of {HEADER_SIZE} bytes)")
    body = bytes(buf[:_BODY.size])
    (crc,) = _CRC.unpack(bytes(buf[_BODY.size:HEADER_SIZE]))
    if xxhash.xxh32_intdigest(body) != crc:
        magic = body[:4]
        raise CorruptBlockError("bad magic" if magic != MAGIC else "header checksum mismatch")
    magic, version, hsize, flags, ns, chain, plen, checksum = _BODY.unpack(body)
    if magic != MAGIC:
        raise CorruptBlockError("bad magic")
    if version != VERSION or hsize != HEADER_SIZE:
        raise CorruptBlockError(f"unsupported block format version {version}")
    return Header(version, flags, ns.hex(), chain.hex(), plen, checksum)


def verify(frame: memoryview | bytes, key: str | None = None, length: int | None = None) -> Header:
    """Check a whole frame (header, expected key, length, payload checksum); return its header.

    `length` is how many bytes of `frame` are valid (default: all of it); padding after the
    payload is allowed. Raises CorruptBlockError with the reason.
    """
    header = parse_header(frame)
    if key is not None and header.key != key:
        what = "namespace" if header.namespace != key[:NS_HEX] else "key"
        raise CorruptBlockError(f"block belongs to another {what}")
    avail = len(frame) if length is None else length
    if header.frame_len > avail:
        raise CorruptBlockError(f"truncated payload ({avail - HEADER_SIZE} of "
                                f"{header.payload_len} bytes)")
    view = memoryview(frame)[HEADER_SIZE:header.frame_len]
    if payload_checksum(view) != header.checksum:
        raise CorruptBlockError("payload checksum mismatch")
    return header


_FIXED = struct.pack("<4sHH", MAGIC, VERSION, HEADER_SIZE)  # bytes 0-8 of every header
KEY_AT, KEY_LEN = 12, 24  # where a header holds its key (namespace and chain), in bytes
assert struct.calcsize("<4sHHI") == KEY_AT and struct.calcsize("<4sHHI8s16s") == KEY_AT + KEY_LEN
_LEN_SUM = struct.Struct("<QQ")  # payload length and checksum, at byte 36


def verified_len(frame: memoryview, key: str, length: int) -> int:
    """`verify(frame, key, length).payload_len` for the read path, same checks at a third of
    the cost (no Header, no hex strings: 511-block loads spent ~2 ms in verify's Python);
    anything unexpected goes through `verify`, which raises naming the reason."""
    head = bytes(frame[:HEADER_SIZE])
    if (len(head) == HEADER_SIZE and head[:8] == _FIXED
            and xxhash.xxh32_intdigest(head[:_BODY.size]) == _CRC.unpack_from(head, _BODY.size)[0]
            and head[KEY_AT:KEY_AT + KEY_LEN] == bytes.fromhex(key)):
        plen, checksum = _LEN_SUM.unpack_from(head, 36)
        end = HEADER_SIZE + plen
        if end <= length and payload_checksum(frame[HEADER_SIZE:end]) == checksum:
            return plen
    return verify(frame, key, length).payload_len


def verify_used(head: memoryview | bytes, key: str, payload_len: int, checksum: int) -> None:
    """Check that a payload a reader used (`payload_len` bytes of this checksum, which it
    computed over its own copy) is the one the header `head`, read from the frame after
    the payload, seals for `key`; raises CorruptBlockError with the reason."""
    head = bytes(head[:HEADER_SIZE])
    if (len(head) == HEADER_SIZE and head[:8] == _FIXED
            and xxhash.xxh32_intdigest(head[:_BODY.size]) == _CRC.unpack_from(head, _BODY.size)[0]
            and head[KEY_AT:KEY_AT + KEY_LEN] == bytes.fromhex(key)
            and _LEN_SUM.unpack_from(head, 36) == (payload_len, checksum)):
        return
    header = parse_header(head)
    if header.key != key:
        what = "namespace" if header.namespace != key[:NS_HEX] else "key"
        raise CorruptBlockError(f"block belongs to another {what}")
    if header.payload_len != payload_len:
        raise CorruptBlockError(f"payload of {payload_len} bytes read, the frame has "
                                f"{header.payload_len}")
    raise CorruptBlockError("payload read differs from the frame's (checksum mismatch)")


def payload(frame: memoryview | bytes) -> memoryview:
    """The payload of a verified frame (a view, no copy)."""
    header = parse_header(frame)
    return memoryview(frame)[HEADER_SIZE:header.frame_len]
