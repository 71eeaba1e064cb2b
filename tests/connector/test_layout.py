"""Layout detection and gather/scatter round trips over every KV layout vLLM builds.

The caches are made by vLLM's own view builder (`create_kv_cache_views`) for each of the six
`KVCacheLayout` stride orders, with and without kernel-block splitting, plus the legacy 5D
per-layer layouts of older vLLM builds. The same logical KV content gathered from any layout
must give byte-identical payloads, and scattering them into any other layout must restore it.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtier.connector.layout import LayoutError, PagedKV, canonical_view
from kvtier.connector.staging import FrameBuffer, StagingPool
from kvtier.store.base import block

vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

L, NB, BS, H, D = 3, 24, 32, 4, 32
M = 2  # blocks per chunk
DTYPE = torch.bfloat16


def logical_content(seed: int = 0) -> list[torch.Tensor]:
    """Per-layer canonical [B, H, N, C] content, C = K (D) then V (D)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NB, H, BS, 2 * D, generator=g).to(DTYPE) for _ in range(L)]


def vllm_cache(layout: KVCacheLayout, kernel_block_size: int | None = None):
    spec = vllm_kv.FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=DTYPE)
    layer_stride, block_stride, *_ = vllm_kv.compute_layout_strides(spec, NB, L, layout)
    size = L * NB * spec.page_size_bytes
    tensor = vllm_kv.KVCacheTensor(size=size, layers=[f"layers.{i}.attn" for i in range(L)],
                                   layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    views = vllm_kv.create_kv_cache_views(raw, spec, NB, layout, tensor, kernel_block_size)
    return dict(zip(tensor.layers, views))


def fill_vllm(caches: dict, content: list[torch.Tensor]) -> None:
    for view, logical in zip(caches.values(), content):
        if view.shape[0] == NB:
            view.copy_(logical)
        else:  # kernel blocks: manager block b, token k*N'+t -> kernel block b*r+k, token t
            r = view.shape[0] // NB
            split = logical.view(NB, H, r, BS // r, 2 * D).permute(0, 2, 1, 3, 4)
            view.copy_(split.reshape(NB * r, H, BS // r, 2 * D))


def read_vllm(caches: dict) -> list[torch.Tensor]:
    out = []
    for view in caches.values():
        if view.shape[0] == NB:
            out.append(view.clone())
        else:
            r = view.shape[0] // NB
            split = view.reshape(NB, r, H, BS // r, 2 * D).permute(0, 2, 1, 3, 4)
            out.append(split.reshape(NB, H, BS, 2 * D))
    return out


LEGACY = {  # name -> (to legacy from canonical [B,H,N,2,D], back)
    "2BNHD": lambda c: c.permute(3, 0, 2, 1, 4),
    "B2NHD": lambda c: c.permute(0, 3, 2, 1, 4),
    "2BHND": lambda c: c.permute(3, 0, 1, 2, 4),
}


def legacy_cache(name: str, content: list[torch.Tensor] | None = None) -> dict:
    """Separate per-layer tensors (not fusable) in an older vLLM layout."""
    caches = {}
    for i in range(L):
        canon = (content[i] if content else torch.zeros(NB, H, BS, 2 * D, dtype=DTYPE))
        caches[f"layers.{i}.attn"] = LEGACY[name](canon.view(NB, H, BS, 2, D)).contiguous()
    return caches


def read_legacy(name: str, caches: dict) -> list[torch.Tensor]:
    return [canonical_view(t, NB, BS)[1].reshape(NB, H, BS, 2 * D) for t in caches.values()]


ALL = [("vllm", lay, None) for lay in KVCacheLayout] + \
      [("vllm", KVCacheLayout.LBHNC, 16), ("vllm", KVCacheLayout.LBNHC, 16)] + \
      [("legacy", name, None) for name in LEGACY]
IDS = [f"{kind}-{getattr(x, 'name', x)}{'-kb' + str(k) if k else ''}" for kind, x, k in ALL]


def build(case, content=None):
    kind, which, kbs = case
    if kind == "vllm":
        caches = vllm_cache(which, kbs)
        if content is not None:
            fill_vllm(caches, content)
        return caches, read_vllm
    return legacy_cache(which, content), lambda c: read_legacy(which, c)


def gather_payloads(paged: PagedKV, ids: torch.Tensor) -> bytes:
    n = ids.shape[0]
    stride = block.frame_size(M * paged.info.block_bytes, block.PAGE)
    buf = FrameBuffer(n, stride, torch.device("cpu"))
    paged.gather(ids, paged.payload_view(buf.device_view, n, stride, block.HEADER_SIZE, M))
    return b"".join(bytes(buf.frame(i)[block.HEADER_SIZE:block.HEADER_SIZE +
                                       M * paged.info.block_bytes]) for i in range(n))


def expected_payloads(content: list[torch.Tensor], ids: torch.Tensor) -> bytes:
    blocks = torch.stack([c[ids.flatten()] for c in content], dim=1)  # [n*m, L, H, N, C]
    return blocks.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("case", ALL, ids=IDS)
def test_gather_gives_canonical_payload(case):
    content = logical_content()
    caches, _ = build(case, content)
    paged = PagedKV(caches, NB, BS)
    assert paged.info.page_shape == (H, BS, 2 * D)
    assert paged.info.num_layers == L
    ids = torch.tensor([[5, 2], [17, 3], [9, 23]])
    assert gather_payloads(paged, ids) == expected_payloads(content, ids)


CONTIGUOUS_PAGES = {"vllm-LBHNC", "vllm-BLHNC"}  # each page one span of memory


@pytest.mark.parametrize("case", ALL, ids=IDS)
def test_checksums_read_in_the_cache_are_those_of_the_stored_payloads(case):
    """`checksums` reads each page where it lies (layouts whose pages are contiguous) and
    equals the checksum of the gathered payload; the first blocks of row 0 come from the
    stored payload given; other layouts say None (the caller gathers and checksums)."""
    content = logical_content(2)
    caches, _ = build(case, content)
    paged = PagedKV(caches, NB, BS)
    ids = torch.tensor([[5, 2], [17, 3], [9, 23]])
    payloads = gather_payloads(paged, ids)
    size = M * paged.info.block_bytes
    want = [block.payload_checksum(payloads[i * size:(i + 1) * size]) for i in range(3)]
    got = paged.checksums(ids.tolist())
    name = IDS[ALL.index(case)]
    if name not in CONTIGUOUS_PAGES:
        assert got is None
        return
    assert got == want
    stored = memoryview(payloads[:size])
    elsewhere = [[40, 2], [17, 3], [9, 23]]   # block 40 is not block 5, but skipped
    assert paged.checksums(elsewhere, 1, stored) == want
    assert paged.checksums(elsewhere)[0] != want[0]
    assert paged.checksums([[5, 2], [40, 3]], 1, stored)[1] != want[1]  # row 0 only


@pytest.mark.parametrize("dst_case", ALL, ids=IDS)
def test_round_trip_across_layouts(dst_case):
    content = logical_content(1)
    src, _ = build(("vllm", KVCacheLayout.LBHNC, None), content)
    src_paged = PagedKV(src, NB, BS)
    ids = torch.tensor([[1, 4], [7, 0], [22, 11], [13, 12]])
    n = ids.shape[0]
    stride = block.frame_size(M * src_paged.info.block_bytes, block.PAGE)
    buf = FrameBuffer(n, stride, torch.device("cpu"))
    src_paged.gather(ids, src_paged.payload_view(buf.device_view, n, stride, 64, M))

    dst, read = build(dst_case)
    dst_paged = PagedKV(dst, NB, BS)
    assert dst_paged.info.page_bytes == src_paged.info.page_bytes
    dst_ids = torch.tensor([[3, 6], [10, 2], [20, 21], [0, 8]])
    dst_paged.scatter(dst_ids, dst_paged.payload_view(buf.device_view, n, stride, 64, M),
                      skip_first=1)
    got = read(dst)
    for layer in range(L):
        for i in range(n):
            for j in range(M):
                block_content = got[layer][dst_ids[i, j]]
                if i == 0 and j < 1:  # skipped: left as it was (zeros)
                    assert not block_content.any()
                else:
                    assert torch.equal(block_content, content[layer][ids[i, j]])
    untouched = set(range(NB)) - set(dst_ids.flatten().tolist())
    assert all(not got[0][b].any() for b in untouched)


def test_fusion_detected_for_shared_storage():
    assert PagedKV(vllm_cache(KVCacheLayout.LBHNC), NB, BS).info.fused
    assert PagedKV(vllm_cache(KVCacheLayout.BLHNC), NB, BS).info.fused
    assert not PagedKV(legacy_cache("2BNHD"), NB, BS).info.fused


def test_shared_layers_counted_once():
    caches = vllm_cache(KVCacheLayout.LBHNC)
    caches["layers.9.attn"] = caches["layers.0.attn"]  # cross-layer KV sharing
    assert PagedKV(caches, NB, BS).info.num_layers == L


def test_unknown_layout_is_a_clear_error():
    with pytest.raises(LayoutError, match=r"unrecognised KV cache tensor of shape \(7, 5\)"):
        PagedKV({"x": torch.zeros(7, 5)}, NB, BS)
    with pytest.raises(LayoutError, match="no KV cache tensors"):
        PagedKV({}, NB, BS)


def test_staging_pool_reuses_and_bounds():
    pool = StagingPool(2, block.PAGE, torch.device("cpu"), max_buffers=2)
    a, b = pool.acquire(), pool.acquire()
    assert pool.in_use == 2
    pool.release(a)
    assert pool.acquire() is a
    pool.release(a)
    pool.release(b)
    assert pool.in_use == 0
    buf = pool.acquire()
    frame = buf.frame(1)
    assert len(frame) == block.PAGE and not buf.mirrored
    frame[:4] = b"KVTB"  # frames are views of the buffer the gather writes
    assert bytes(buf.host[block.PAGE:block.PAGE + 4].numpy()) == b"KVTB"


def _resident_pages(buf: FrameBuffer) -> int:
    """Pages of the buffer's host memory mapped in now (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    n = buf.host.numel()
    vec = ctypes.create_string_buffer(n // block.PAGE)
    assert libc.mincore(buf.host.data_ptr(), n, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


def test_staging_pool_warm_makes_buffers_mapped_in_and_registered():
    made = []
    pool = StagingPool(64, block.PAGE, torch.device("cpu"), max_buffers=2, on_new=made.append)
    cold = pool.acquire()
    assert _resident_pages(cold) == 0  # a buffer made on first use has no page yet
    pool.release(cold)
    assert pool.warm(3) == 1  # one more fits under max_buffers
    assert len(made) == 2 and pool.in_use == 0
    warm = made[1]
    assert _resident_pages(warm) == 64
    assert {id(pool.acquire()), id(pool.acquire())} == {id(cold), id(warm)}
    assert pool.warm(1) == 0


def test_staging_pool_gives_back_the_slot_of_a_buffer_it_could_not_make():
    fail = [True]

    def register(_buf):
        if fail[0]:
            raise RuntimeError("registration refused")
    pool = StagingPool(1, block.PAGE, torch.device("cpu"), max_buffers=1, on_new=register)
    with pytest.raises(RuntimeError, match="registration refused"):
        pool.warm(1)
    with pytest.raises(RuntimeError, match="registration refused"):
        pool.acquire(timeout_s=1)
    fail[0] = False
    assert pool.acquire(timeout_s=1) is not None and pool.in_use == 1
